"""Documents into ``seq_len + 1``-token windows, with segment ids, positions and loss masks.

A document longer than a window is cut into pieces of ``seq_len + 1`` tokens that overlap by
one (each piece's last token is the next one's first), so every target is predicted exactly
once; positions restart in each piece. Pieces with no target to train on (a prompt cut off
from its answer) are dropped. With packing, pieces go into windows best-fit decreasing (the
longest first, each into the window with the least room that holds it: 0.98 of the tokens are
documents' for the SFT example's 48-token conversations in 129-token windows, against 0.82
filling windows in order); without, each piece has its own window. A window's pieces keep
their documents' order; the rest of it is padding: segment 0, masked.

The packing is computed once (deterministic), so a window is an index: shuffling, resuming and
slicing by process work on indices, as for a token stream.

A held-out split with fewer windows than one batch is evaluated as one padded batch
(:func:`padded_batches`): its windows, then rows whose loss mask is 0 everywhere, which add
nothing to the loss's sum or to its token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zjax.data._store import Documents
from zjax.errors import ConfigError

__all__ = ["PackedWindows", "PaddedWindows", "pack", "padded_batches"]


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


class _Rooms:
    """Which free-room sizes ``0..capacity`` some window has, with the smallest size at
    least ``n`` found in ``O(log capacity)`` (a segment tree of "any window here")."""

    def __init__(self, capacity: int):
        self.size = 1 << max(1, capacity).bit_length()
        self.any = bytearray(2 * self.size)
        self.windows: list[list[int]] = [[] for _ in range(capacity + 1)]

    def _mark(self, room: int, on: bool) -> None:
        i = room + self.size
        self.any[i] = on
        i //= 2
        while i and self.any[i] != (self.any[2 * i] or self.any[2 * i + 1]):
            self.any[i] = self.any[2 * i] or self.any[2 * i + 1]
            i //= 2

    def add(self, room: int, window: int) -> None:
        self.windows[room].append(window)
        if len(self.windows[room]) == 1:
            self._mark(room, True)

    def take(self, n: int) -> tuple[int, int] | None:
        """``(room, window)`` of a window with the least room >= ``n``, removed; or None."""
        i = n + self.size
        if not self.any[i]:  # climb until a right sibling holds some room, then descend
            while i > 1 and (i % 2 or not self.any[i + 1]):
                i //= 2
            if i <= 1:
                return None
            i += 1
            while i < self.size:
                i = 2 * i if self.any[2 * i] else 2 * i + 1
        room = i - self.size
        window = self.windows[room].pop()
        if not self.windows[room]:
            self._mark(room, False)
        return room, window


def _best_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Each piece's window: pieces by decreasing length, each into the window with the least
    room that holds it, or a new one (best-fit decreasing; deterministic)."""
    rooms = _Rooms(capacity)
    window_of = np.empty(len(lengths), np.int64)
    opened = 0
    for p in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[p])
        found = rooms.take(n)
        if found is None:
            room, window, opened = capacity, opened, opened + 1
        else:
            room, window = found
        window_of[p] = window
        if room - n > 0:
            rooms.add(room - n, window)
    return window_of


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
    window_of = (_best_fit(lengths, seq_len + 1) if packing
                 else np.arange(len(starts), dtype=np.int64))
    order = np.argsort(window_of, kind="stable")  # a window's pieces in document order
    bounds = np.concatenate([[0], np.cumsum(np.bincount(window_of))]).astype(np.int64)
    return PackedWindows(docs, starts[order], lengths[order], bounds, seq_len, dropped)


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
        lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
        starts, lengths = self.starts[lo:hi], self.lengths[lo:hi]
        n, used = self.seq_len + 1, int(lengths.sum())
        # each token's piece, and its place in the piece: one gather from the documents
        positions = np.arange(used) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        index = np.repeat(starts, lengths) + positions
        out = {"tokens": self.docs.tokens[index],
               "segment_ids": np.repeat(np.arange(1, hi - lo + 1), lengths),
               "positions": positions, "loss_mask": self.docs.loss_mask[index]}
        return {k: np.pad(v.astype(np.int32), (0, n - used)) for k, v in out.items()}


class PaddedWindows:
    """The windows of ``parts`` one after the other, then padding up to ``rows``: each
    padding row is a dict of zeros like a window's (segment 0, loss mask 0).

    Args:
      parts: sequences of windows (dicts of int32 ``[seq_len + 1]`` arrays).
      rows: the length, at least the windows'.
      like: the fields of a padding row (a window's keys).
    """

    def __init__(self, parts: Sequence[Sequence[Any]], rows: int, seq_len: int,
                 like: Sequence[str]):
        self.parts, self.rows, self.seq_len, self.like = list(parts), rows, seq_len, like

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        for part in self.parts:
            if i < len(part):
                return part[i]
            i -= len(part)
        return {k: np.zeros(self.seq_len + 1, np.int32) for k in self.like}


def padded_batches(windows: PaddedWindows, *, process_index: int, process_count: int):
    """The one global batch of ``windows`` (padded to its rows), again and again: this
    process's rows of it, as a grain iterator (``get_state``/``set_state``)."""
    import grain

    ds = grain.MapDataset.source(windows).repeat()
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(windows.rows // process_count, drop_remainder=True)
    return iter(ds.to_iter_dataset())
