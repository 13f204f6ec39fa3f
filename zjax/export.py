"""Gathered export (DeepSpeed's ``save_16bit_model`` / ``zero_to_fp32``): params only, unsharded.

The export reads the run's newest intact checkpoint one leaf at a time (an Orbax partial
restore straight to host numpy, never onto a device), casts it to the export dtype, and writes
either a plain Orbax checkpoint of numpy arrays, which a program without zjax restores with
``ocp.StandardCheckpointer().restore(path)`` on any device count, or a ``.safetensors`` file
streamed leaf by leaf. Both hold one leaf in host memory at a time (the Orbax one through
Orbax's partial save, one leaf per save), so the peak stays near the largest leaf whatever the
model's size: see ``benchmarks/export_memory.py`` for the measured figures.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1

from zjax.errors import CheckpointError, ConfigError, did_you_mean
from zjax.partition.config import resolve_dtype

__all__ = ["FORMATS", "export"]

log = logging.getLogger("zjax")
FORMATS = ("orbax", "safetensors")
_CHUNK_BYTES = 16 << 20  # per stored chunk of an exported leaf
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _latest_state_dir(run_dir: Path) -> tuple[int, Path]:
    ckpt = run_dir / "checkpoints"
    steps = sorted((int(p.name) for p in ckpt.iterdir() if p.name.isdigit()), reverse=True) \
        if ckpt.is_dir() else []
    for step in steps:
        state = ckpt / str(step) / "state"
        if (ckpt / str(step) / "commit_success.txt").exists() or (state / "_METADATA").exists():
            return step, state
    raise CheckpointError(f"export: {str(run_dir)!r} holds no checkpoint (looked in {ckpt})")


def _param_leaves(state_dir: Path) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    try:
        meta = ocp.PyTreeCheckpointer().metadata(state_dir).item_metadata["params"]
    except Exception as e:  # unreadable metadata: a damaged checkpoint
        raise CheckpointError(f"export: cannot read {state_dir}: {e}") from None
    flat = jax.tree_util.tree_flatten_with_path(meta)[0]
    return [(tuple(str(k.key) for k in path), tuple(m.shape)) for path, m in flat]


def _read_leaf(state_dir: Path, keys: tuple[str, ...], shape, dtype: np.dtype) -> np.ndarray:
    item: dict = {}
    args: dict = {}
    node_i, node_a = item, args
    for key in keys[:-1]:
        node_i, node_a = node_i.setdefault(key, {}), node_a.setdefault(key, {})
    node_i[keys[-1]] = np.zeros((), np.float32)  # structure only; restore_args carry the type
    node_a[keys[-1]] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)  # cast as it reads
    out = ocp.PyTreeCheckpointer().restore(
        state_dir, args=ocp.args.PyTreeRestore(item={"params": item},
                                                restore_args={"params": args},
                                                partial_restore=True))["params"]
    for key in keys:
        out = out[key]
    if tuple(out.shape) != tuple(shape):
        raise CheckpointError(f"export: leaf {'/'.join(keys)} read as {out.shape}, not {shape}")
    return out


def export(run_dir: str | Path, out: str | Path, *, dtype: str = "bfloat16",
           format: str = "orbax") -> Path:
    """Write the params of ``run_dir``'s newest checkpoint to ``out`` in ``dtype``.

    Args:
      run_dir: a run directory (it holds ``checkpoints/``).
      out: a new directory (Orbax) or file (safetensors); an existing one is never replaced.
      dtype: ``float32``, ``bfloat16`` or ``float16``.
      format: ``orbax`` or ``safetensors``.

    Returns:
      The path written.
    """
    target = resolve_dtype(dtype, key="--dtype")
    if format not in FORMATS:
        raise ConfigError(f"--format: {format!r} is not supported{did_you_mean(format, FORMATS)};"
                          f" choose one of {', '.join(FORMATS)}")
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise CheckpointError(f"export: {str(out)!r} already exists; zjax does not replace it")
    step, state_dir = _latest_state_dir(run_dir)
    leaves = _param_leaves(state_dir)
    log.info("exporting %d params leaves of step %d in %s as %s", len(leaves), step,
             target.name, format)
    if format == "safetensors":
        _write_safetensors(out, state_dir, leaves, target)
        return out
    _write_orbax(out, state_dir, leaves, target)
    return out


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
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for keys, shape in leaves:  # one leaf in host memory at a time, written without a copy
            leaf = _read_leaf(state_dir, keys, shape, target)
            f.write(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).data)
            del leaf
    tmp.replace(out)

