"""Reading a checkpoint's params leaf by leaf and writing new files whole or not at all: what
``zjax export`` and ``zjax import-hf`` share."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1

from zjax.checkpoint._digest import array_digest, recorded_digests
from zjax.errors import CheckpointError, DamagedCheckpoint, first_line, is_damage

__all__ = ["check_out", "item_read", "nested", "read_leaf", "write_orbax_leaves"]

_CHUNK_BYTES = 16 << 20  # per stored chunk of an exported leaf


def check_out(out: Path, *, what: str = "export") -> None:
    """Refuse an ``out`` that exists or whose parent is missing or unwritable, before any work
    (``what``: the command, for the messages)."""
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"{what}: {str(out)!r} already exists; zjax does not replace it")
    parent = out.parent
    if not parent.is_dir():
        raise CheckpointError(
            f"{what}: cannot write {str(out)!r}: its parent directory {str(parent)!r} "
            f"{'is not a directory' if parent.exists() else 'does not exist'}; "
            "expected an existing, writable directory")
    try:  # a real write: permission bits do not tell for root, read-only mounts, quotas
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.zjax-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(
            f"{what}: cannot write {str(out)!r}: its parent directory {str(parent)!r} is not "
            f"writable ({e.strerror or e}); expected a writable directory") from None


def _verify_leaf(state_dir: Path, keys: tuple[str, ...], leaf: np.ndarray) -> None:
    """Raise if ``leaf`` (as stored, before the cast) differs from the digest its checkpoint
    recorded at save time; a checkpoint written without digests is not checked."""
    recorded = _recorded(state_dir)
    if recorded is None:
        return
    key = "/".join(("params", *keys))  # zjax.checkpoint._digest.leaf_name of the canonical tree
    if key in recorded and recorded[key] != array_digest(leaf):
        raise DamagedCheckpoint("reads back other values than were written (checksum mismatch)")


@functools.lru_cache(maxsize=8)
def _recorded(state_dir: Path) -> dict[str, str] | None:
    return recorded_digests(state_dir.parent)


class _ItemMetadataFilter(logging.Filter):
    """Drops Orbax's warning that an item directory (a step's ``state``) has no
    ``_CHECKPOINT_METADATA``: that file is the step's, one level up, and zjax reads the item
    on purpose (one leaf, without the manager)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("Metadata file does not exist")
                    and record.getMessage().endswith("_CHECKPOINT_METADATA"))


@contextlib.contextmanager
def item_read() -> Iterator[None]:
    """A block that reads one item of a step directory with Orbax's checkpointers."""
    absl = logging.getLogger("absl")
    quiet = _ItemMetadataFilter()
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


def read_leaf(state_dir: Path, keys: tuple[str, ...], shape, dtype: np.dtype, *,
              params_only: bool = False) -> np.ndarray:
    """The leaf ``keys`` of ``state_dir``'s params cast to ``dtype``.

    Args:
      state_dir: a training checkpoint's ``state`` item (its params under ``params``), or
        with ``params_only`` a params tree saved alone (``zjax import-hf``'s ``params/``,
        ``zjax export --format orbax``), which records no digests.

    Raises:
      DamagedCheckpoint: it cannot be read, or reads back other values than were saved.
    """
    item: dict = {}
    args: dict = {}
    node_i, node_a = item, args
    for key in keys[:-1]:
        node_i, node_a = node_i.setdefault(key, {}), node_a.setdefault(key, {})
    node_i[keys[-1]] = np.zeros((), np.float32)  # structure only; restore_args carry the type
    node_a[keys[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)  # as stored, to verify it
    name = "/".join(keys)
    if not params_only:
        item, args = {"params": item}, {"params": args}
    try:
        with item_read():
            out = ocp.PyTreeCheckpointer().restore(
                state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                        partial_restore=True))
        for key in keys if params_only else ("params", *keys):
            out = out[key]
        if tuple(out.shape) != tuple(shape):
            raise DamagedCheckpoint(f"read as {out.shape}, its metadata says {shape}")
        if not params_only:
            _verify_leaf(state_dir, keys, out)
    except Exception as e:  # what Orbax/Tensorstore raise on bad data is damage; else a bug
        if not is_damage(e):
            raise
        raise DamagedCheckpoint(f"leaf {name}: {type(e).__name__}: {first_line(e)}") from None
    return out.astype(dtype, copy=False)


def write_orbax_leaves(out: Path, leaves: Iterable[tuple[tuple[str, ...], np.ndarray]], *,
                       what: str = "export", shown: Path | None = None) -> None:
    """An Orbax checkpoint at ``out`` of the nested dict whose leaves ``leaves`` yields
    (``(keys, host array)``), one leaf in host memory at a time.

    One Orbax partial save per leaf; the finished checkpoint's pytree directory is then moved
    to ``out``, which therefore appears whole or not at all and restores with the plain
    ``ocp.StandardCheckpointer().restore(out)``.

    Raises:
      CheckpointError: naming ``what`` and ``shown`` (default ``out``: the path the user
        asked for), when Orbax cannot write (a full disk:
        Tensorstore's errors are ValueErrors, and Orbax's writer threads log each one with a
        traceback, which are silenced here); errors of ``leaves`` pass through.
    """
    work = out.parent.resolve() / f".{out.name}.zjax-export"
    shutil.rmtree(work, ignore_errors=True)  # what an interrupted export left behind
    try:
        with _orbax_context():
            for keys, tree in leaves:
                for key in reversed(keys):
                    tree = {key: tree}
                _orbax_write(ocp_v1.partial.save, work / "ckpt", tree, out=shown or out,
                             what=what)
                del tree
            _orbax_write(ocp_v1.partial.finalize, work / "ckpt", out=shown or out, what=what)
        (work / "ckpt" / "state").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _orbax_write(fn, *args, out: Path, what: str) -> None:
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)  # the writer threads' tracebacks of the error raised here
    try:
        fn(*args)
    except (ValueError, RuntimeError) as e:  # Tensorstore's RESOURCE_EXHAUSTED, ...
        code = re.search(r"os_error_code='(\d+)'", str(e))
        why = os.strerror(int(code.group(1))) if code else first_line(e)[:300]
        raise CheckpointError(f"{what}: cannot write {str(out)!r}: {why}") from None
    finally:
        absl.setLevel(level)


def _orbax_context() -> ocp_v1.Context:
    # no defensive copy of each leaf (nothing else holds it), and bounded chunks so that
    # Tensorstore never encodes a whole large leaf into one buffer
    ctx = ocp_v1.Context()
    ctx.memory.deepcopy_host_arrays = False
    ctx.array.saving.storage_options.chunk_byte_size = _CHUNK_BYTES
    return ctx


def nested(leaves: Iterable[tuple[tuple[str, ...], Any]]) -> dict:
    """The nested dict whose leaves are ``(keys, value)``."""
    out: dict = {}
    for keys, value in leaves:
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return out
