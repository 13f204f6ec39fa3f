"""Reading a checkpoint that a training run may delete under the reader (``checkpoint.keep``).

Orbax's rotation unlinks a step's files in parallel and removes the directory last, so a reader
in its way meets missing or empty files in a directory that still looks committed: damage, by
every sign the files give. What tells the two apart is the directory itself: a deleted step
loses files (or vanishes) between the reader's listing and its failure; a damaged one does not.

:func:`pinned` reads through hard links made in a scratch directory on the same filesystem, so
that a deletion cannot reach the files once they are linked (a link keeps its inode); across
filesystems it reads in place, and the caller retries on :class:`Vanished`. A pin is named by
host and pid: one that a killed reader left is removed by the next reader there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Vanished", "committed", "listing", "pinned", "vanished"]

_NO_LINKS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)
_GRACE_S = 0.5  # a deletion that has just begun has removed no file yet
_PIN, _HOST = ".zjax-pinned-", socket.gethostname()


class Vanished(Exception):
    """The checkpoint being read was deleted under the reader: not damage."""


def committed(state_dir: Path) -> bool:
    """Whether ``state_dir``'s step is a finished checkpoint (Orbax's commit marker)."""
    step = state_dir.parent
    return (step / "commit_success.txt").exists() or (state_dir / "_METADATA").exists()


def listing(step: Path) -> frozenset[str]:
    """The files under ``step``, relative to it (empty where it is gone)."""
    try:
        return frozenset(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file())
    except OSError:  # removed while walked
        return frozenset()


def vanished(state_dir: Path, before: frozenset[str]) -> bool:
    """Whether ``state_dir``'s step has been (or is being) deleted since it held ``before``."""
    for wait in (0.0, _GRACE_S):
        time.sleep(wait)
        if not committed(state_dir) or not before <= listing(state_dir.parent):
            return True
    return False


@contextlib.contextmanager
def pinned(state_dir: Path, scratch: Path | None, before: frozenset[str]) -> Iterator[Path]:
    """``state_dir``, or a hard-linked copy of its step directory under ``scratch``.

    Raises:
      Vanished: the step lost files of ``before`` while they were being linked.
    """
    step = state_dir.parent
    tmp = None
    if scratch is not None:
        _remove_dead_pins(scratch)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_PIN}{_HOST}-{os.getpid()}-{step.name}-",
                                    dir=scratch))
    try:
        if tmp is None or not _links_work(step, tmp):  # another filesystem: read in place
            yield state_dir
            return
        copy = tmp / step.name
        try:
            shutil.copytree(step, copy, copy_function=os.link)
        except OSError as e:  # files removed while being linked
            raise Vanished from e
        if not before <= listing(copy):  # removed before they were linked
            raise Vanished
        yield copy / state_dir.name
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_dead_pins(scratch: Path) -> None:
    """Remove the pins a killed reader on this host left under ``scratch`` (they keep a
    deleted checkpoint's files on disk)."""
    for p in scratch.glob(f"{_PIN}{_HOST}-*"):
        pid = p.name.removeprefix(f"{_PIN}{_HOST}-").split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _links_work(step: Path, tmp: Path) -> bool:
    """Whether files of ``step`` can be hard-linked into ``tmp``."""
    probe = next((p for p in step.rglob("*") if p.is_file()), None)
    if probe is None:
        raise Vanished
    try:
        os.link(probe, tmp / ".probe")
    except FileNotFoundError:
        raise Vanished from None
    except OSError as e:
        if e.errno in _NO_LINKS:
            return False
        raise
    (tmp / ".probe").unlink()
    return True
