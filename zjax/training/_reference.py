"""``preference.reference: precompute``: the reference's log-probability of every sequence
of the train and eval splits, computed once by the starting weights before training and
carried in the batches (``ref_logps``), so no reference is held while training.

The values are written to the run directory (``reference_logps.npz``, beside what they were
computed for: the data section, ``train.init_from`` and each source's row count) and read
back when the run resumes, so a resumed run compares with the same reference without a
second pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zjax.errors import ConfigError
from zjax.step import ZeroStep

__all__ = ["FILE", "StartState", "check_pairs", "precomputed_reference"]

FILE = "reference_logps.npz"


def _identity(config, data: dict) -> str:
    """What the values depend on: the data (its digest), the starting weights, the model."""
    whole = config.to_dict()
    return json.dumps({**{k: whole[k] for k in ("data", "model", "lora", "zero")},
                       "init_from": config.train.init_from, "seed": config.train.seed,
                       "rows": data}, sort_keys=True, default=str)


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


def _score_source(zstep: ZeroStep, state, rows: Any, size: int, put: Callable,
                  process: tuple[int, int]) -> np.ndarray:
    """``zstep.score`` of every row of ``rows`` (:class:`zjax.data.preference_rows`' per
    source), in order. Each process feeds block ``index`` of each
    global batch and reads back its own rows' values from its addressable shards (in the
    order it fed them, whatever the devices' layout), then the processes exchange theirs."""
    out = []
    index, count = process
    per = size // count  # this process's rows of the global batch
    for lo in range(0, len(rows), size):
        n, batch = min(size, len(rows) - lo), rows.batch(lo, size)  # the last one padded
        local = {k: v[index * per:(index + 1) * per] for k, v in batch.items()}
        values = _local_values(zstep.score(state.params, put(local), state.frozen))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            blocks = multihost_utils.process_allgather(values)  # [processes, per]
            slots = multihost_utils.process_allgather(np.asarray(index))
            values = np.empty(size, np.float32)
            for block, slot in zip(blocks, slots, strict=True):
                values[int(slot) * per:(int(slot) + 1) * per] = block
        out.append(values[:n])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def _local_values(values: jax.Array) -> np.ndarray:
    """This process's rows of a row-split global array, in global order (one copy of each)."""
    seen = {}
    for shard in values.addressable_shards:
        start = shard.index[0].start or 0
        seen.setdefault(start, np.asarray(shard.data, np.float32))
    return np.concatenate([seen[k] for k in sorted(seen)])


def _digest(sources: dict[str, list]) -> str:
    """The data the values are of: each split's sources' tokens and loss masks."""
    h = hashlib.sha256()
    for split in sorted(sources):
        for rows in sources[split]:
            docs = rows.docs
            lo, hi = int(docs.offsets[0]), int(docs.offsets[-1])  # the split's own tokens
            for arr in (np.asarray(docs.offsets) - lo, docs.tokens[lo:hi],
                        docs.loss_mask[lo:hi]):
                for lo in range(0, len(arr), 1 << 24):  # memory-mapped: read by chunks
                    h.update(np.ascontiguousarray(arr[lo:lo + (1 << 24)]).tobytes())
    return h.hexdigest()


def precomputed_reference(zstep: ZeroStep, rows: dict[str, Any], config, *,
                          start: Callable[[], Any], put: Callable, process: tuple[int, int],
                          run_dir: Path | None, info: Callable
                          ) -> tuple[dict[str, tuple], Callable[[Path], None]]:
    """``(values, keep)``: per split, each source's per-sequence reference log-probs
    (float32, document order), and ``keep(run_dir)``, which writes newly computed values
    there for a resume (the trainer calls it once the run's checks have passed).

    Args:
      zstep: the step (its ``score``: the sequences' log-probs under given weights).
      rows: per split, :func:`zjax.data.preference_rows` of it.
      config: the run's config.
      start: ``start() -> TrainState`` at step 0 (the starting weights).
      put: a process's rows of a global batch -> the global batch.
      process: ``(index, count)`` of the processes the batch's rows are split over.
      run_dir: where values kept by an earlier start of this run are read from (None: none).
      info: the run's progress log.
    """
    sources = {split: list(r.sources) for split, r in rows.items()}
    counts = {split: [len(x) for x in s] for split, s in sources.items()}
    identity = _identity(config, {"counts": counts, "data": _digest(sources)})
    path = None if run_dir is None else Path(run_dir) / FILE
    found = _read(path, identity, sources)
    if jax.process_count() > 1:  # every process scores, or none: a collective
        from jax.experimental import multihost_utils

        if not np.all(multihost_utils.process_allgather(np.asarray(found is not None))):
            found = None
    if found is not None:
        info("reference log-probs read from %s", path)
        return found, lambda run_dir: None
    info("precomputing the reference's log-probs of %d sequences",
         sum(sum(c) for c in counts.values()))
    state = start()
    values = {split: tuple(_score_source(zstep, state, x, config.data.batch_size, put, process)
                           for x in s) for split, s in sources.items()}
    del state

    def keep(run_dir: Path) -> None:
        if jax.process_index() == 0:
            _write(Path(run_dir) / FILE, identity, values)

    return values, keep


class StartState:
    """A run's initial state, made on first use and kept until the start takes it (the
    precompute pass and the start share one; a resume drops it)."""

    def __init__(self, make: Callable[[], Any]):
        self._make, self._state = make, None

    def peek(self) -> Any:
        if self._state is None:
            self._state = self._make()
        return self._state

    def take(self) -> Any:
        state, self._state = self.peek(), None
        return state

    def drop(self) -> None:
        self._state = None


def _inert_keys(section: Any, name: str) -> list[str]:
    """``name.key`` of each key of ``section`` set (not its default) while its ``method``
    is empty: nothing reads them."""
    if section.method is not None:
        return []
    out = []
    for f in dataclasses.fields(section):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        if getattr(section, f.name) != default:
            out.append(f"{name}.{f.name}")
    return out


def check_pairs(config) -> None:
    """A preference method trains on pairs, and pairs are for a preference method; GRPO
    samples from prompts, and prompts are for GRPO. The ``rl`` and ``preference`` keys set
    while their section's method is empty are said, one warning per section: nothing reads
    them (a forgotten ``method``, or a section left from another run)."""
    for name in ("rl", "preference"):
        inert = _inert_keys(getattr(config, name), name)
        if inert:
            logging.getLogger("zjax").warning(
                "%s: set, but %s.method is empty, so nothing reads them; set %s.method to "
                "use them, or remove them", ", ".join(inert), name, name)
    if config.rl.enabled != (config.data.format == "prompt"):
        if config.rl.enabled:
            raise ConfigError(f"data.format: {config.data.format}, but rl.method "
                              f"{config.rl.method} samples completions of prompts; set "
                              "data.format: prompt")
        raise ConfigError("rl.method: empty, but data.format prompt holds prompts without "
                          "answers to train on; set rl.method: grpo (and rl.rewards)")
    if not config.preference.enabled:
        if config.data.format == "preference":
            raise ConfigError("preference.method: empty, but data.format preference holds "
                              "pairs of a chosen and a rejected answer (next-token training "
                              "would learn the rejected ones too); set preference.method: "
                              "dpo, ipo, simpo or orpo")
        return
    if config.data.format != "preference":
        raise ConfigError(f"data.format: {config.data.format}, but preference.method "
                          f"{config.preference.method} trains on pairs of a chosen and a "
                          "rejected answer; set data.format: preference (rows with prompt, "
                          "chosen and rejected)")
