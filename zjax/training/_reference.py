"""``preference.reference: precompute``: the reference's log-probability of every sequence
of the train and eval splits, computed once by the starting weights before training and
carried in the batches (``ref_logps``), so no reference is held while training.

The values are written to the run directory (``reference_logps.npz``, beside what they were
computed for: the data section, ``train.init_from`` and each source's row count) and read
back when the run resumes, so a resumed run compares with the same reference without a
second pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zjax.errors import ConfigError
from zjax.step import ZeroStep

__all__ = ["FILE", "check_pairs", "precomputed_reference"]

FILE = "reference_logps.npz"


def _identity(config, counts: dict) -> str:
    """What the values depend on: the data, the starting weights, the model."""
    whole = config.to_dict()
    return json.dumps({**{k: whole[k] for k in ("data", "model", "lora", "zero")},
                       "init_from": config.train.init_from, "seed": config.train.seed,
                       "counts": counts}, sort_keys=True, default=str)


def _read(path: Path | None, identity: str, splits) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as f:
            if str(f["identity"]) != identity:
                return None
            return {split: tuple(f[f"{split}_{k}"] for k in range(int(f[f"{split}_sources"])))
                    for split in splits}
    except (OSError, ValueError, KeyError):  # damaged: computed again
        return None


def _write(path: Path, identity: str, values: dict) -> None:
    arrays = {f"{split}_{k}": v for split, vs in values.items() for k, v in enumerate(vs)}
    counts = {f"{split}_sources": np.asarray(len(vs)) for split, vs in values.items()}
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez(tmp, identity=np.asarray(identity), **counts, **arrays)
    tmp.replace(path)  # whole or not at all


def _batches(rows: Sequence[dict], size: int):
    """``rows`` in global batches of ``size`` (the last one padded with all-zero rows)."""
    for lo in range(0, len(rows), size):
        chunk = [rows[i] for i in range(lo, min(lo + size, len(rows)))]
        n = len(chunk)
        chunk += [{k: np.zeros_like(v) for k, v in chunk[0].items()}] * (size - n)
        yield n, {k: np.stack([r[k] for r in chunk]) for k in chunk[0]}


def _score_source(zstep: ZeroStep, state, rows: Sequence[dict], size: int, put: Callable,
                  process: tuple[int, int]) -> np.ndarray:
    out = []
    index, count = process
    for n, batch in _batches(rows, size):
        per = size // count  # this process's rows of the global batch
        local = {k: v[index * per:(index + 1) * per] for k, v in batch.items()}
        values = zstep.score(state.params, put(local), state.frozen)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            values = multihost_utils.process_allgather(values, tiled=True)
        out.append(np.asarray(values, np.float32)[:n])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def precomputed_reference(zstep: ZeroStep, rows: dict[str, Any], config, *,
                          start: Callable[[], Any], put: Callable, process: tuple[int, int],
                          run_dir: Path | None, info: Callable) -> dict[str, tuple]:
    """Per split, each source's per-sequence reference log-probs (float32, document order).

    Args:
      zstep: the step (its ``score``: the sequences' log-probs under given weights).
      rows: per split, :func:`zjax.data.preference_rows` of it.
      config: the run's config.
      start: ``start() -> TrainState`` at step 0 (the starting weights).
      put: a process's rows of a global batch -> the global batch.
      process: ``(index, count)`` of the processes the batch's rows are split over.
      run_dir: where the values are kept for a resume (None: not kept).
      info: the run's progress log.
    """
    sources = {split: list(r.sources) for split, r in rows.items()}
    identity = _identity(config, {split: [len(x) for x in s] for split, s in sources.items()})
    path = None if run_dir is None else Path(run_dir) / FILE
    found = _read(path, identity, sources)
    if found is not None:
        info("reference log-probs read from %s", path)
        return found
    info("precomputing the reference's log-probs of %d sequences",
         sum(len(x) for s in sources.values() for x in s))
    state = start()
    values = {split: tuple(_score_source(zstep, state, x, config.data.batch_size, put, process)
                           for x in s) for split, s in sources.items()}
    del state
    if path is not None and jax.process_index() == 0:
        _write(path, identity, values)
    return values


def check_pairs(config) -> None:
    """A preference method trains on pairs: the data must be in the preference format."""
    if config.data.format != "preference":
        raise ConfigError(f"data.format: {config.data.format}, but preference.method "
                          f"{config.preference.method} trains on pairs of a chosen and a "
                          "rejected answer; set data.format: preference (rows with prompt, "
                          "chosen and rejected)")
