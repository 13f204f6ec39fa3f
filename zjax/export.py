"""Gathered export (DeepSpeed's ``save_16bit_model`` / ``zero_to_fp32``): params only, unsharded.

The export reads the run's newest intact checkpoint one leaf at a time (an Orbax partial
restore straight to host numpy, never onto a device), casts it to the export dtype, and writes
either a plain Orbax checkpoint of numpy arrays, which a program without zjax restores with
``ocp.StandardCheckpointer().restore(path)`` on any device count, or a ``.safetensors`` file
streamed leaf by leaf. Measured (``benchmarks/export_memory.py``, 235M params, 940 MB float32,
largest leaf 268 MB): safetensors peaks at 1.5-1.7x the largest leaf; the Orbax writer takes
the whole tree at once and peaks at ~3x the export's size.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from zjax.errors import CheckpointError, ConfigError, did_you_mean
from zjax.partition.config import resolve_dtype

__all__ = ["FORMATS", "export"]

log = logging.getLogger("zjax")
FORMATS = ("orbax", "safetensors")
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


def _read_leaf(state_dir: Path, keys: tuple[str, ...], shape) -> np.ndarray:
    item: dict = {}
    args: dict = {}
    node_i, node_a = item, args
    for key in keys[:-1]:
        node_i, node_a = node_i.setdefault(key, {}), node_a.setdefault(key, {})
    node_i[keys[-1]] = np.zeros((), np.float32)  # structure only; restore_args carry the type
    node_a[keys[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
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
    tree: dict = {}
    for keys, shape in leaves:
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = _read_leaf(state_dir, keys, shape).astype(target, copy=False)
    # synchronous, and writes bounded to 1 GB at a time: the async checkpointer copies every
    # array before returning
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler(save_concurrent_gb=1))
    ckptr.save(out.resolve(), args=ocp.args.StandardSave(tree))
    return out


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
            leaf = _read_leaf(state_dir, keys, shape).astype(target, copy=False)
            f.write(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).data)
            del leaf
    tmp.replace(out)
