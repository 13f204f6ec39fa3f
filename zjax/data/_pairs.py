"""Preference documents as batches of pairs (``data.format: preference``).

A source's documents ``2k`` and ``2k + 1`` are pair ``k``'s chosen and rejected sequences
(:mod:`zjax.data._preference`). Each sequence is one row of ``seq_len + 1`` tokens (cut to fit
as it was encoded; never packed): a dict of int32 arrays ``tokens``, ``segment_ids`` (1 on the
sequence's tokens, 0 on padding), ``positions`` (0, 1, ...; 0 on padding) and ``loss_mask``
(the answer's tokens), padded with zeros.

The train/eval split is by pairs: the eval split is each source's last
``int(pairs * data.eval_fraction)`` pairs. Pairs are shuffled every epoch from the seed, mixed
by weight, sliced by process and batched; a batch is a dict of ``[rows, seq_len + 1]`` arrays
whose pairs are interleaved: row ``2i`` is pair ``i``'s chosen sequence, row ``2i + 1`` its
rejected one. ``data.batch_size`` counts rows (two per pair). The iterator is grain's, so its
``get_state()`` / ``set_state()`` resume at the exact next batch.

Reference log-probabilities (``ref_logps``: one float32 per document of each source's split,
computed over :func:`preference_rows`) ride along as a float32 ``[rows]`` array aligned
with the rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grain
import jax
import numpy as np

from zjax.data._records import BATCH_FIELDS, Corpus, warn_no_eval
from zjax.data._store import Documents
from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["PreferenceRows", "SequenceRows", "abstract_preference_batch", "preference_batches",
           "preference_rows"]


class SequenceRows:
    """Random access to a source's sequences, one row each: row ``i`` is document ``i`` as a
    dict of int32 ``[seq_len + 1]`` arrays (the module docstring's fields)."""

    def __init__(self, docs: Documents, seq_len: int):
        lengths = np.diff(np.asarray(docs.offsets, np.int64))
        if len(lengths) and int(lengths.max()) > seq_len + 1:
            raise ConfigError(f"data.seq_len: {seq_len}, but {docs.source} holds a preference "
                              f"sequence of {int(lengths.max())} tokens, more than one row of "
                              f"{seq_len + 1}; tokenize it again with --seq-len {seq_len}")
        self.docs, self.seq_len = docs, seq_len

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        a, b = int(self.docs.offsets[i]), int(self.docs.offsets[i + 1])
        n = b - a
        out = {k: np.zeros(self.seq_len + 1, np.int32) for k in BATCH_FIELDS}
        out["tokens"][:n] = self.docs.tokens[a:b]
        out["segment_ids"][:n] = 1
        out["positions"][:n] = np.arange(n)
        out["loss_mask"][:n] = self.docs.loss_mask[a:b]
        return out

    def batch(self, start: int, size: int) -> dict[str, np.ndarray]:
        """Rows ``start .. start + size`` as int32 ``[size, seq_len + 1]`` arrays; rows past
        the last are all zero (padding: no token, no loss)."""
        rows = [self[i] for i in range(start, min(start + size, len(self)))]
        pad = {k: np.zeros(self.seq_len + 1, np.int32) for k in BATCH_FIELDS}
        rows += [pad] * (size - len(rows))
        return {k: np.stack([r[k] for r in rows]) for k in BATCH_FIELDS}


@dataclasses.dataclass(frozen=True)
class PreferenceRows:
    """Every sequence of each source's split, for computing one value per document (the
    reference model's log-probabilities).

    Attributes:
      sources: per source of the corpus (its order), its split's sequences in document order
        (:class:`SequenceRows`: ``rows[i]`` a dict of int32 ``[seq_len + 1]`` arrays,
        ``rows.batch(start, size)`` of ``[size, seq_len + 1]`` ones, padded past the end);
        documents ``2k`` and ``2k + 1`` are pair ``k``'s chosen and rejected sequences.
    """

    sources: tuple[SequenceRows, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        """Each source's rows (twice its pairs): the length of its ``ref_logps``."""
        return tuple(len(s) for s in self.sources)


class _Pairs:
    """Pair ``k`` of a source: a dict of int32 ``[2, seq_len + 1]`` arrays (its chosen and
    rejected rows) and, with ``ref``, float32 ``ref_logps [2]``."""

    def __init__(self, rows: SequenceRows, ref: np.ndarray | None = None):
        self.rows, self.ref = rows, ref

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        k = int(k)
        chosen, rejected = self.rows[2 * k], self.rows[2 * k + 1]
        out = {f: np.stack([chosen[f], rejected[f]]) for f in BATCH_FIELDS}
        if self.ref is not None:
            out["ref_logps"] = np.asarray(self.ref[2 * k:2 * k + 2], np.float32)
        return out


class _PaddedPairs:
    """The pairs of ``parts`` one after the other, then pairs of padding (all zero) up to
    ``pairs``."""

    def __init__(self, parts: Sequence[_Pairs], pairs: int, seq_len: int):
        self.parts, self.pairs, self.seq_len = list(parts), pairs, seq_len

    def __len__(self) -> int:
        return self.pairs

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        k = int(k)
        for part in self.parts:
            if k < len(part):
                return part[k]
            k -= len(part)
        out = {f: np.zeros((2, self.seq_len + 1), np.int32) for f in BATCH_FIELDS}
        if self.parts and self.parts[0].ref is not None:
            out["ref_logps"] = np.zeros(2, np.float32)
        return out


def _interleave(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``[pairs, 2, ...]`` to ``[2 * pairs, ...]``: row ``2i`` chosen, ``2i + 1`` rejected."""
    return {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items()}


def _split(corpus: Corpus, data: DataConfig, split: str) -> tuple[tuple[Documents, float], ...]:
    """Each source's train pairs, or its held-out last pairs (``eval``), as documents."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if data.format != "preference":
        raise ConfigError(f"data.format: {data.format}, but preference batches need "
                          "data.format preference")
    out = []
    for docs, weight in corpus.sources:
        made = docs.meta.get("format", "preference")
        if made != "preference" or len(docs) % 2:
            what = (f"{made} documents" if made != "preference"
                    else f"{len(docs)} documents, an odd number")
            raise ConfigError(f"data.path: {docs.source} holds {what}, not preference pairs "
                              "(a chosen and a rejected sequence each); tokenize it with "
                              "--format preference")
        pairs = len(docs) // 2
        cut = 2 * (pairs - int(pairs * data.eval_fraction))
        out.append((docs.select(0, cut) if split == "train" else docs.select(cut, len(docs)),
                    weight))
    return tuple(out)


def preference_rows(corpus: Corpus, data: DataConfig, *, split: str = "train"
                    ) -> PreferenceRows:
    """Each source's ``split`` sequences in document order (for ``ref_logps``)."""
    return PreferenceRows(tuple(SequenceRows(docs, data.seq_len)
                                for docs, _ in _split(corpus, data, split)))


def _check_batch(data: DataConfig, process_count: int) -> int:
    """The pairs of a global batch, checked: even rows, whole pairs on every process."""
    if data.batch_size % 2:
        raise ConfigError(f"data.batch_size: {data.batch_size}, but data.format preference "
                          "puts a pair's chosen and rejected sequences side by side: use an "
                          "even number of rows (2 per pair)")
    pairs = data.batch_size // 2
    if pairs % process_count:
        raise ConfigError(f"data.batch_size: {data.batch_size} rows are {pairs} preference "
                          f"pairs, not divisible by the {process_count} processes (each takes "
                          f"whole pairs); use a multiple of {2 * process_count}")
    return pairs


def _ref(ref_logps: Sequence[np.ndarray], k: int, docs: Documents) -> np.ndarray:
    values = np.asarray(ref_logps[k], np.float32)
    if values.shape != (len(docs),):
        raise ValueError(f"ref_logps[{k}] has shape {values.shape}, expected ({len(docs)},): "
                         f"one value per document of {docs.source}'s split")
    return values


def _sources(corpus: Corpus, data: DataConfig, split: str, ref_logps) -> list:
    """``(k, pairs, weight)`` of each source with a pair; a train split short of one batch
    is refused."""
    splits = _split(corpus, data, split)
    if ref_logps is not None and len(ref_logps) != len(splits):
        raise ValueError(f"ref_logps: {len(ref_logps)} arrays for the {split} split; expected "
                         f"one per source ({len(splits)})")
    found = []
    for k, (docs, weight) in enumerate(splits):
        pairs = _Pairs(SequenceRows(docs, data.seq_len),
                       None if ref_logps is None else _ref(ref_logps, k, docs))
        if split == "train" and len(pairs) < data.batch_size // 2:
            raise ConfigError(
                f"data.batch_size: {data.batch_size}, but the train split of {docs.source} "
                f"holds {len(pairs)} preference pairs ({2 * len(pairs)} rows), fewer than one "
                "batch; lower data.batch_size or add data")
        if len(pairs):
            found.append((k, pairs, weight))
    return found


def preference_batches(corpus: Corpus, data: DataConfig, *, split: str, seed: int,
                       process_index: int = 0, process_count: int = 1,
                       ref_logps: Sequence[np.ndarray] | None = None
                       ) -> grain.DatasetIterator | None:
    """A checkpointable iterator of this process's batches: dicts of int32
    ``[batch_size / processes, seq_len + 1]`` arrays (the module docstring's fields, pairs
    interleaved), pairs reshuffled every epoch from ``seed``.

    Args:
      ref_logps: per source of ``corpus`` (its order), one float32 per document of its
        ``split`` (``preference_rows(...).counts``); each batch then has float32
        ``ref_logps`` ``[rows]``, aligned with its rows (0 on an eval batch's padding).

    An ``eval`` split with fewer pairs than one batch gives that one batch again and again,
    padded with rows of zeros (loss mask 0), its pairs interleaved; one with no pair gives None
    (no evaluation) and logs a warning. A ``train`` split too small for one batch is refused.
    """
    pairs = _check_batch(data, process_count)
    found = _sources(corpus, data, split, ref_logps)
    if not found:
        warn_no_eval(data, corpus.source, "preference pair")
        return None
    if split == "eval" and sum(len(p) for _, p, _ in found) < pairs:
        ds = grain.MapDataset.source(_PaddedPairs([p for _, p, _ in found], pairs,
                                                  data.seq_len)).repeat()
    else:
        parts = [grain.MapDataset.source(p).shuffle(seed=seed + k).repeat()
                 for k, p, _ in found]
        weights = [weight for _, _, weight in found]
        ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(pairs // process_count, drop_remainder=True).map(_interleave)
    return iter(ds.to_iter_dataset())


def abstract_preference_batch(data: DataConfig, *, ref_logps: bool
                              ) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch of preference pairs, as ``ShapeDtypeStruct``s (nothing read): int32
    ``[batch_size, seq_len + 1]`` fields, and float32 ``ref_logps [batch_size]`` if asked."""
    shape = (data.batch_size, data.seq_len + 1)
    out = {k: jax.ShapeDtypeStruct(shape, np.int32) for k in BATCH_FIELDS}
    if ref_logps:
        out["ref_logps"] = jax.ShapeDtypeStruct((data.batch_size,), np.float32)
    return out
