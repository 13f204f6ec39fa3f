"""Gathered export (DeepSpeed's ``save_16bit_model`` / ``zero_to_fp32``): params only, unsharded.

The export reads the run's newest intact checkpoint one leaf at a time (an Orbax partial
restore straight to host numpy, never onto a device), casts it to the export dtype, and writes
either a plain Orbax checkpoint of numpy arrays, which a program without zjax restores with
``ocp.StandardCheckpointer().restore(path)`` on any device count, or a ``.safetensors`` file
streamed leaf by leaf. Both hold one leaf in host memory at a time, as stored and cast (the
Orbax one through Orbax's partial save, one leaf per save), so the peak stays near the largest
leaf whatever the model's size: see ``benchmarks/export_memory.py`` for the measured figures.

The run directory is only read. A checkpoint that cannot be read (damaged) is skipped with a
warning naming its step, and the next older one is exported instead, as a resumed run falls
back; unlike a resume (``Checkpointer.restore_latest``, which needs the run's step and moves
damaged checkpoints aside), the export moves and changes nothing in the run directory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1

from zjax._digest import array_digest, recorded_digests
from zjax.errors import (
    CheckpointError,
    ConfigError,
    DamagedCheckpoint,
    did_you_mean,
    first_line,
    is_damage,
)
from zjax.partition.config import resolve_dtype

__all__ = ["FORMATS", "export"]

log = logging.getLogger("zjax")
FORMATS = ("orbax", "safetensors")
_CHUNK_BYTES = 16 << 20  # per stored chunk of an exported leaf
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _state_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's committed checkpoints as ``(step, state directory)``, newest first."""
    ckpt = run_dir / "checkpoints"
    steps = sorted((int(p.name) for p in ckpt.iterdir() if p.name.isdigit()), reverse=True) \
        if ckpt.is_dir() else []
    found = [(step, ckpt / str(step) / "state") for step in steps
             if (ckpt / str(step) / "commit_success.txt").exists()
             or (ckpt / str(step) / "state" / "_METADATA").exists()]
    if not found:
        raise CheckpointError(f"export: {str(run_dir)!r} holds no checkpoint (looked in {ckpt})")
    return found


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that exists or whose parent is missing or unwritable, before any work."""
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"export: {str(out)!r} already exists; zjax does not replace it")
    parent = out.parent
    if not parent.is_dir():
        raise CheckpointError(
            f"export: cannot write {str(out)!r}: its parent directory {str(parent)!r} "
            f"{'is not a directory' if parent.exists() else 'does not exist'}; "
            "expected an existing, writable directory")
    try:  # a real write: permission bits do not tell for root, read-only mounts, quotas
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.zjax-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(
            f"export: cannot write {str(out)!r}: its parent directory {str(parent)!r} is not "
            f"writable ({e.strerror or e}); expected a writable directory") from None


def _param_leaves(state_dir: Path) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    try:
        meta = ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata
        params = meta["params"] if meta is not None else None
    except Exception as e:
        if not is_damage(e):
            raise
        raise DamagedCheckpoint(
            f"metadata unreadable: {type(e).__name__}: {first_line(e)}") from None
    if params is None:
        raise DamagedCheckpoint("its metadata lists no params")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(tuple(str(k.key) for k in path), tuple(m.shape)) for path, m in flat]


def _verify_leaf(state_dir: Path, keys: tuple[str, ...], leaf: np.ndarray) -> None:
    """Raise if ``leaf`` (as stored, before the cast) differs from the digest its checkpoint
    recorded at save time; a checkpoint written without digests is not checked."""
    recorded = _recorded(state_dir)
    if recorded is None:
        return
    key = "/".join(("params", *keys))  # zjax._digest.leaf_name of the canonical tree
    if key in recorded and recorded[key] != array_digest(leaf):
        raise DamagedCheckpoint("reads back other values than were written (checksum mismatch)")


@functools.lru_cache(maxsize=8)
def _recorded(state_dir: Path) -> dict[str, str] | None:
    return recorded_digests(state_dir.parent)


def _read_leaf(state_dir: Path, keys: tuple[str, ...], shape, dtype: np.dtype) -> np.ndarray:
    """The leaf ``keys`` of ``state_dir``'s params cast to ``dtype``.

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
    try:
        out = ocp.PyTreeCheckpointer().restore(
            state_dir, args=ocp.args.PyTreeRestore(item={"params": item},
                                                    restore_args={"params": args},
                                                    partial_restore=True))["params"]
        for key in keys:
            out = out[key]
        if tuple(out.shape) != tuple(shape):
            raise DamagedCheckpoint(f"read as {out.shape}, its metadata says {shape}")
        _verify_leaf(state_dir, keys, out)
    except Exception as e:  # what Orbax/Tensorstore raise on bad data is damage; else a bug
        if not is_damage(e):
            raise
        raise DamagedCheckpoint(f"leaf {name}: {type(e).__name__}: {first_line(e)}") from None
    return out.astype(dtype, copy=False)


def export(run_dir: str | Path, out: str | Path, *, dtype: str = "bfloat16",
           format: str = "orbax") -> Path:
    """Write the params of ``run_dir``'s newest intact checkpoint to ``out`` in ``dtype``.

    A damaged checkpoint is skipped with a warning naming its step, and the next older one
    is exported; nothing in ``run_dir`` is moved or changed.

    Args:
      run_dir: a run directory (it holds ``checkpoints/``).
      out: a new directory (Orbax) or file (safetensors) in an existing, writable directory;
        an existing one is never replaced.
      dtype: ``float32``, ``bfloat16`` or ``float16``.
      format: ``orbax`` or ``safetensors``.

    Returns:
      The path written.

    Raises:
      ConfigError: an unknown ``dtype`` or ``format``.
      CheckpointError: ``out`` exists or cannot be written, or ``run_dir`` holds no intact
        checkpoint.
    """
    target = resolve_dtype(dtype, key="--dtype")
    if format not in FORMATS:
        raise ConfigError(f"--format: {format!r} is not supported{did_you_mean(format, FORMATS)};"
                          f" choose one of {', '.join(FORMATS)}")
    out = Path(out)
    _check_out(out)
    # Orbax reads a checkpoint's metadata only through an absolute path (a relative one
    # reads as no metadata at all)
    candidates = _state_dirs(Path(run_dir).resolve())
    damaged = []
    for i, (step, state_dir) in enumerate(candidates):
        try:
            leaves = _param_leaves(state_dir)
            log.info("exporting %d params leaves of step %d in %s as %s", len(leaves), step,
                     target.name, format)
            write = _write_safetensors if format == "safetensors" else _write_orbax
            try:
                write(out, state_dir, leaves, target)
            except DamagedCheckpoint:  # the input side (an OSError too): fall back
                raise
            except OSError as e:  # the output side: a full disk, a vanished directory
                raise CheckpointError(f"export: cannot write {str(out)!r}: {e}") from None
            return out
        except DamagedCheckpoint as e:
            damaged.append(f"step {step}: {e}")
            older = (f"falling back to step {candidates[i + 1][0]}" if i + 1 < len(candidates)
                     else "no older checkpoint")
            log.warning("export: checkpoint at step %d in %s is damaged (%s); %s (the run "
                        "directory is left as it is)", step, state_dir.parent.parent, e, older)
    raise CheckpointError(
        f"export: no intact checkpoint in {str(Path(run_dir))!r}: all {len(damaged)} are "
        f"damaged (newest, {damaged[0]}); nothing written")


def _write_orbax(out: Path, state_dir: Path, leaves, target: np.dtype) -> None:
    # One Orbax partial save per leaf, so only one leaf is ever in host memory; the finished
    # checkpoint's pytree directory is then moved to ``out``, which therefore appears whole
    # or not at all and restores with the plain ``ocp.StandardCheckpointer().restore(out)``.
    work = out.parent.resolve() / f".{out.name}.zjax-export"
    shutil.rmtree(work, ignore_errors=True)  # what an interrupted export left behind
    try:
        with _orbax_context():
            for keys, shape in leaves:
                tree = _read_leaf(state_dir, keys, shape, target)
                for key in reversed(keys):
                    tree = {key: tree}
                ocp_v1.partial.save(work / "ckpt", tree)
                del tree
            ocp_v1.partial.finalize(work / "ckpt")
        (work / "ckpt" / "state").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _orbax_context() -> ocp_v1.Context:
    # no defensive copy of each leaf (nothing else holds it), and bounded chunks so that
    # Tensorstore never encodes a whole large leaf into one buffer
    opts = ocp_v1.options
    saving = opts.ArrayOptions.Saving(
        storage_options=opts.ArrayOptions.Saving.StorageOptions(chunk_byte_size=_CHUNK_BYTES))
    return ocp_v1.Context(memory_options=opts.MemoryOptions(deepcopy_host_arrays=False),
                          array_options=opts.ArrayOptions(saving=saving))


def _write_safetensors(out: Path, state_dir: Path, leaves, target: np.dtype) -> None:
    header, offset = {}, 0
    for keys, shape in leaves:
        size = int(np.prod(shape, dtype=np.int64)) * target.itemsize
        header[".".join(keys)] = {"dtype": _SAFETENSORS_DTYPES[target.name], "shape": list(shape),
                                  "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = out.with_name(out.name + ".partial")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for keys, shape in leaves:  # one leaf in host memory at a time, written unsplit
                leaf = _read_leaf(state_dir, keys, shape, target)
                f.write(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).data)
                del leaf
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
