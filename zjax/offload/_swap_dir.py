"""A run's own directory of swap files under ``nvme_path``, locked for as long as it lives.

Several runs (or the processes of one run) may share one ``nvme_path``: each creates a
directory ``zjax-swap-HOST-PID-TOKEN`` of its own and holds an exclusive ``flock`` on its
``lock`` file until it closes, so no run ever opens another's files. The kernel drops the lock
when its process dies, however it dies: a directory whose lock can be taken belongs to a run
that ended without cleaning up (``kill -9``, a crash), and the next run to open a store under
the same path removes it (saying whose it was) before it checks the free space. ``owner.json``
says whose a directory is: written after the lock is taken, so a directory without it is still
being created and is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

__all__ = ["PREFIX", "SwapDir", "SwapOwner", "remove_stale", "swap_dirs"]

log = logging.getLogger("zjax")
PREFIX = "zjax-swap-"
_LOCK, _OWNER = "lock", "owner.json"


class SwapOwner(NamedTuple):
    """Whose swap directory this is (``owner.json``) and what it holds.

    Attributes:
      path: the directory.
      live: its run still holds the lock.
      owner: ``{"pid", "host", "started", "command", "cwd"}`` as the run wrote it.
      nbytes: bytes of its files.
    """

    path: Path
    live: bool
    owner: dict
    nbytes: int

    def describe(self) -> str:
        o = self.owner
        return (f"pid {o.get('pid', '?')} on {o.get('host', '?')}, started "
                f"{o.get('started', '?')}, `{o.get('command', '?')}` in {o.get('cwd', '?')}; "
                f"{self.nbytes / 2**30:.2f} GiB in {self.path}")


def _nbytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):  # the directory or a file removed meanwhile
        for f in path.iterdir():
            with contextlib.suppress(OSError):
                total += f.stat().st_size
    return total


def _read_owner(path: Path) -> dict | None:
    try:
        owner = json.loads((path / _OWNER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _inspect(path: Path, *, remove_if_stale: bool) -> SwapOwner | None:
    """``path``'s owner; with ``remove_if_stale``, a dead run's directory is removed (under
    its lock, so two runs starting at once never both remove it)."""
    try:
        fd = os.open(path / _LOCK, os.O_RDWR)
    except OSError:  # no lock file yet (being created) or already removed
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(path)
            return None if owner is None else SwapOwner(path, True, owner, _nbytes(path))
        owner = _read_owner(path)
        if owner is None:  # the creator took the lock file but not yet the lock
            return None
        found = SwapOwner(path, False, owner, _nbytes(path))
        if remove_if_stale:
            shutil.rmtree(path, ignore_errors=True)
        return found
    finally:
        os.close(fd)


def swap_dirs(root: Path) -> list[SwapOwner]:
    """The swap directories under ``root`` that have an owner, live or not (nothing removed)."""
    found = (_inspect(p, remove_if_stale=False) for p in sorted(root.glob(f"{PREFIX}*")))
    return [s for s in found if s is not None]


def remove_stale(root: Path, *, key: str) -> list[SwapOwner]:
    """Remove the swap directories under ``root`` whose runs are gone; log each one."""
    removed = []
    for p in sorted(root.glob(f"{PREFIX}*")):
        s = _inspect(p, remove_if_stale=True)
        if s is not None and not s.live:
            log.info("%s: removed the swap files of a run that ended without removing them "
                     "(%s)", key, s.describe())
            removed.append(s)
    return removed


class SwapDir:
    """A new swap directory under ``root``, locked until :meth:`close`.

    Args:
      root: ``nvme_path`` (an existing, writable directory).

    Raises:
      OSError: the directory or its lock cannot be created.
    """

    def __init__(self, root: Path):
        name = f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = Path(root) / name
        self.path.mkdir(mode=0o700)
        self._fd: int | None = None
        try:
            self._fd = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            # blocking: another run's sweep may hold it for the moment it takes to see that
            # this directory has no owner yet
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            owner = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "command": " ".join(sys.argv), "cwd": os.getcwd()}
            tmp = self.path / f".{_OWNER}.partial"
            tmp.write_text(json.dumps(owner))
            tmp.replace(self.path / _OWNER)
        except BaseException:
            self.close()
            raise

    def close(self, *, remove: bool = True) -> None:
        """Remove the directory (with ``remove``) and release the lock."""
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
