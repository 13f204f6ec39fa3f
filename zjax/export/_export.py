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

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from zjax.checkpoint import check_out, item_read, nested, read_leaf, write_orbax_leaves
from zjax.errors import (
    CheckpointError,
    ConfigError,
    DamagedCheckpoint,
    did_you_mean,
    first_line,
    is_damage,
)
from zjax.export._pin import Vanished, committed, listing, pinned, vanished
from zjax.partition.config import resolve_dtype

__all__ = ["FORMATS", "export", "newest_intact", "read_params"]
T = TypeVar("T")

log = logging.getLogger("zjax")
FORMATS = ("orbax", "safetensors", "hf", "peft")


def _state_dirs(run_dir: Path, *, what: str) -> list[tuple[int, Path]]:
    """The run's committed checkpoints as ``(step, state directory)``, newest first."""
    ckpt = run_dir / "checkpoints"
    steps = sorted((int(p.name) for p in ckpt.iterdir() if p.name.isdigit()), reverse=True) \
        if ckpt.is_dir() else []
    found = [(step, ckpt / str(step) / "state") for step in steps
             if committed(ckpt / str(step) / "state")]
    if not found:
        raise CheckpointError(f"{what}: {str(run_dir)!r} holds no checkpoint (looked in {ckpt})")
    return found


def _param_leaves(state_dir: Path) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    try:
        with item_read():
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


def export(run_dir: str | Path, out: str | Path, *, dtype: str = "bfloat16",
           format: str = "orbax", max_shard_bytes: int | None = None) -> Path:
    """Write the params of ``run_dir``'s newest intact checkpoint to ``out`` in ``dtype``.

    A damaged checkpoint is skipped with a warning naming its step, and the next older one
    is exported; nothing in ``run_dir`` is moved or changed.

    Args:
      run_dir: a run directory (it holds ``checkpoints/``).
      out: a new directory (Orbax) or file (safetensors) in an existing, writable directory;
        an existing one is never replaced.
      dtype: ``float32``, ``bfloat16`` or ``float16``.
      format: ``orbax``, ``safetensors``, ``hf`` (a directory Hugging Face
        ``transformers`` loads: the architecture the run started from, else the first that
        holds the model, :mod:`zjax.hf`), or ``peft`` (a LoRA run's adapters as PEFT's
        adapter directory).
      max_shard_bytes: ``hf``: split the weights into files of at most this size (default
        5 GB, as ``save_pretrained``).

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
    check_out(out)
    writers = {"orbax": _write_orbax, "safetensors": _write_safetensors}
    if format == "hf":
        from zjax.hf import DEFAULT_SHARD_BYTES, hf_writer

        writers["hf"] = hf_writer(Path(run_dir), max_shard_bytes=max_shard_bytes
                                  or DEFAULT_SHARD_BYTES)
    if format == "peft":
        from zjax.hf import peft_writer

        writers["peft"] = peft_writer(Path(run_dir))

    def write(step: int, state_dir: Path, leaves) -> Path:
        log.info("exporting %d params leaves of step %d in %s as %s", len(leaves), step,
                 target.name, format)
        try:
            writers[format](out, state_dir, leaves, target)
        except DamagedCheckpoint:  # the input side (an OSError too): fall back
            raise
        except OSError as e:  # the output side: a full disk, a vanished directory
            raise CheckpointError(f"export: cannot write {str(out)!r}: {e}") from None
        return out

    return newest_intact(run_dir, write, what="export", nothing="nothing written",
                         scratch=out.parent.resolve())


_ATTEMPTS = 5  # listings of a run whose checkpoints rotate away while being read


def newest_intact(run_dir: str | Path, use: Callable[[int, Path, list], T], *,
                  what: str, nothing: str, scratch: Path | None = None) -> T:
    """``use(step, state_dir, params leaves)`` on the newest checkpoint of ``run_dir`` it
    reads without :class:`DamagedCheckpoint`, warning of each damaged one (left as it is).

    A training run may delete a checkpoint while it is read (``checkpoint.keep``). With
    ``scratch`` (a directory on the run's filesystem) the checkpoint is first pinned: its
    files hard-linked there, so a deletion cannot reach what is read. Without it, or across
    filesystems, a checkpoint that vanishes is not damage: the run is listed again and its
    newest checkpoint read, up to ``_ATTEMPTS`` times (:mod:`zjax.export._pin`).
    """
    # Orbax reads a checkpoint's metadata only through an absolute path (a relative one
    # reads as no metadata at all)
    root = Path(run_dir).resolve()
    for _ in range(_ATTEMPTS):
        try:
            return _newest_intact(root, use, what=what, nothing=nothing, scratch=scratch)
        except Vanished:
            continue
    raise CheckpointError(
        f"{what}: found no finished checkpoint in {str(Path(run_dir))!r} that stayed while it "
        f"was read ({_ATTEMPTS} tries: the run deletes them faster, checkpoint.keep); "
        f"{nothing}. Retry, or raise checkpoint.keep")


def _newest_intact(root: Path, use: Callable[[int, Path, list], T], *, what: str,
                   nothing: str, scratch: Path | None) -> T:
    candidates = _state_dirs(root, what=what)
    damaged = []
    for i, (step, state_dir) in enumerate(candidates):
        before = listing(state_dir.parent)
        try:
            with pinned(state_dir, scratch, before) as path:
                return use(step, path, _param_leaves(path))
        except Exception as e:
            if isinstance(e, Vanished) or vanished(state_dir, before):
                raise Vanished from e
            if not isinstance(e, DamagedCheckpoint):
                raise
            damaged.append(f"step {step}: {e}")
            older = (f"falling back to step {candidates[i + 1][0]}"
                     if i + 1 < len(candidates) else "no older checkpoint")
            log.warning("%s: checkpoint at step %d in %s is damaged (%s); %s (the run "
                        "directory is left as it is)", what, step, state_dir.parent.parent,
                        e, older)
    raise CheckpointError(
        f"{what}: no intact checkpoint in {str(root)!r}: all {len(damaged)} are "
        f"damaged (newest, {damaged[0]}); {nothing}")


def read_params(run_dir: str | Path, *, dtype=np.float32) -> tuple[int, dict]:
    """``(step, params)`` of ``run_dir``'s newest intact checkpoint, as host numpy arrays."""
    def read(step: int, state_dir: Path, leaves) -> tuple[int, dict]:
        return step, nested((keys, read_leaf(state_dir, keys, shape, np.dtype(dtype)))
                            for keys, shape in leaves)

    return newest_intact(run_dir, read, what="sample", nothing="nothing to load")


def _write_orbax(out: Path, state_dir: Path, leaves, target: np.dtype) -> None:
    write_orbax_leaves(out, ((keys, read_leaf(state_dir, keys, shape, target))
                             for keys, shape in leaves))


def _write_safetensors(out: Path, state_dir: Path, leaves, target: np.dtype) -> None:
    from zjax.hf import write_safetensors

    write_safetensors(out, [(".".join(keys), shape, target) for keys, shape in leaves],
                      lambda: (read_leaf(state_dir, keys, shape, target)
                               for keys, shape in leaves))
