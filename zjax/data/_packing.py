"""Documents into ``seq_len + 1``-token windows, with segment ids, positions and loss masks.

A document longer than a window is cut into pieces of ``seq_len + 1`` tokens that overlap by
one (each piece's last token is the next one's first), so every target is predicted exactly
once; positions restart in each piece. Pieces with no target to train on (a prompt cut off
from its answer) are dropped. With packing, pieces fill windows in order, a piece that does
not fit starting the next window; without, each piece has its own window. The rest of a
window is padding: segment 0, masked.

The packing is computed once (deterministic: the documents' order), so a window is an index:
shuffling, resuming and slicing by process work on indices, as for a token stream.
"""

from __future__ import annotations

import numpy as np

from zjax.data._store import Documents
from zjax.errors import ConfigError

__all__ = ["PackedWindows", "pack"]


def _pieces(docs: Documents, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of every document's pieces, in order."""
    offsets = np.asarray(docs.offsets, np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    keep = lengths >= 2  # a one-token document has no target
    starts, lengths = starts[keep], lengths[keep]
    count = -(-(lengths - 1) // seq_len)
    doc = np.repeat(np.arange(len(starts)), count)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(count) - count, count)
    piece_start = starts[doc] + k * seq_len
    piece_len = np.minimum(seq_len + 1, lengths[doc] - k * seq_len)
    return piece_start, piece_len


def _targets(docs: Documents, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """How many of each piece's targets (its tokens after the first) are trained on: the
    mask summed in chunks of about 16M tokens (a memory-mapped mask is never read whole)."""
    out = np.empty(len(starts), np.int64)
    step = max(1, (1 << 24) // int(lengths.max(initial=1)))
    for lo in range(0, len(starts), step):
        s, e = starts[lo:lo + step], starts[lo:lo + step] + lengths[lo:lo + step]
        a = int(s[0])
        total = np.concatenate([[0], np.cumsum(docs.loss_mask[a:int(e.max())], dtype=np.int64)])
        out[lo:lo + step] = total[e - a] - total[s + 1 - a]
    return out


def _greedy(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The first piece of each window (and one past the last), pieces packed in order."""
    bounds, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > capacity:
            bounds.append(i)
            used = 0
        used += n
    bounds.append(len(lengths))
    return np.asarray(bounds, np.int64)


def pack(docs: Documents, *, seq_len: int, packing: bool) -> PackedWindows:
    """The windows of ``docs``.

    Raises:
      ConfigError: when no window holds a token to train on.
    """
    starts, lengths = _pieces(docs, seq_len)
    trained = _targets(docs, starts, lengths) > 0
    dropped = int(np.sum(~trained))
    starts, lengths = starts[trained], lengths[trained]
    if len(starts) == 0:
        raise ConfigError(f"data.path: {docs.source} holds no token to train on (its "
                          f"{len(docs)} documents have no target under their loss masks)")
    bounds = (_greedy(lengths, seq_len + 1) if packing
              else np.arange(len(starts) + 1, dtype=np.int64))
    return PackedWindows(docs, starts, lengths, bounds, seq_len, dropped)


class PackedWindows:
    """Random access to the packed windows: window ``i`` is a dict of int32 ``[seq_len + 1]``
    arrays ``tokens``, ``segment_ids`` (1, 2, ... per piece; 0 padding), ``positions`` and
    ``loss_mask``."""

    def __init__(self, docs: Documents, starts, lengths, bounds, seq_len: int, dropped: int):
        self.docs, self.starts, self.lengths, self.bounds = docs, starts, lengths, bounds
        self.seq_len, self.dropped = seq_len, dropped

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def fill(self) -> float:
        """The share of window tokens that are document tokens (not padding)."""
        return float(self.lengths.sum()) / max(1, len(self) * (self.seq_len + 1))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = self.seq_len + 1
        out = {k: np.zeros(n, np.int32) for k in ("tokens", "segment_ids", "positions",
                                                    "loss_mask")}
        at = 0
        lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
        for seg, p in enumerate(range(lo, hi), 1):
            s, m = int(self.starts[p]), int(self.lengths[p])
            out["tokens"][at:at + m] = self.docs.tokens[s:s + m]
            out["loss_mask"][at:at + m] = self.docs.loss_mask[s:s + m]
            out["segment_ids"][at:at + m] = seg
            out["positions"][at:at + m] = np.arange(m)
            at += m
        return out
