"""The text data pipeline: files -> tokens -> shuffled windows -> this process's batches.

Built on grain: a ``MapDataset`` of fixed-length windows over a token stream, reshuffled every
epoch from the seed, sliced so each process reads only its own part of every global batch, and
batched. The iterator's ``get_state()`` / ``set_state()`` make it checkpointable: a resumed run
continues from the exact next batch.

Sources (``data.path``):
- None: the ``.py`` files of Python's standard library, byte-level (every machine has them);
- a text file, a directory (all files under it) or a glob: byte-level;
- a ``.npy`` file: a flat array of token ids (memory-mapped, never read whole; ``zjax
  tokenize`` writes one).

Text is byte-level unless ``data.tokenizer`` names a ``tokenizer.json`` (:mod:`zjax.data.tokenize`).
Every byte of every file is read: files are joined by a newline; byte-level, one file is
memory-mapped and several are read into one array (no copy of it held twice); with a
tokenizer, the text is encoded in pieces of about a million characters cut at line ends (the
tokenizer's threads encode them in parallel) and only the ids are kept. The default source,
the standard library, is about 30 MB (read in under a second, once per process, and
kept read-only).
"""

from __future__ import annotations

import functools
import glob
import io
import itertools
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["BYTE_VOCAB", "DataConfig", "Tokens", "load_tokens", "stdlib_files", "text_files",
           "window_batches"]

BYTE_VOCAB = 256
STDLIB = "the Python standard library"  # the default source's name in messages


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this Python's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def text_files(path: str, *, key: str = "data.path") -> list[Path]:
    """The files of a text file, a directory (all files under it) or a glob, sorted."""
    from zjax.data._sources import is_partial  # what an interrupted `zjax tokenize` left

    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*")
                       if f.is_file() and not is_partial(f.relative_to(p)))
        if not files:
            raise ConfigError(f"{key}: directory {path!r} holds no file")
        return files
    if p.is_file():
        return [p]
    files = sorted(Path(f) for f in glob.glob(os.fspath(path), recursive=True)
                   if Path(f).is_file() and not is_partial(Path(f)))
    if not files:
        raise ConfigError(f"{key}: {path!r} does not exist and matches no file as a glob")
    return files


class Tokens:
    """A token stream split into a train part and a held-out eval part (the tail)."""

    def __init__(self, tokens: np.ndarray, *, eval_fraction: float, source: str):
        if tokens.ndim != 1:
            raise ConfigError(
                f"data.path: {source} must hold a flat token array, got shape {tokens.shape}"
            )
        n_eval = int(len(tokens) * eval_fraction)
        self.train = tokens[: len(tokens) - n_eval]
        self.eval = tokens[len(tokens) - n_eval:]
        self.source = source
        if tokens.dtype == np.uint8:  # bytes (a memory-mapped file is not read here)
            self.vocab_size = BYTE_VOCAB
        else:
            self.vocab_size = int(tokens.max()) + 1 if len(tokens) else 0

    def split(self, name: str) -> np.ndarray:
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        return self.train if name == "train" else self.eval


def load_tokens(path: str | None = None, *, eval_fraction: float = 0.05,
                max_bytes: int | None = None, tokenizer: str | None = None) -> Tokens:
    """Read the token stream of ``data.path`` (see the module docstring for the sources).

    ``tokenizer``: a ``tokenizer.json`` that text sources are encoded with (byte-level
    without); the stream's vocabulary is then the tokenizer's. ``max_bytes``: read only the
    first this many bytes of the text (a sample, asked for; the default reads everything).
    """
    tokens = _load_tokens(path, eval_fraction=eval_fraction, max_bytes=max_bytes,
                          tokenizer=tokenizer)
    if tokenizer is not None:
        from zjax.data._tokenizer import id_bound, load_tokenizer

        tokens.vocab_size = max(tokens.vocab_size, id_bound(load_tokenizer(tokenizer)))
    return tokens


def _load_tokens(path: str | None, *, eval_fraction: float, max_bytes: int | None,
                 tokenizer: str | None) -> Tokens:
    if path is not None and str(path).lower().endswith(".npy") and Path(path).is_file():
        from zjax.data._store import check_npy_tokenizer

        check_npy_tokenizer(path, tokenizer)  # its record names the tokenizer of its ids
        return Tokens(_token_array(str(path)), eval_fraction=eval_fraction, source=str(path))
    if path is None and tokenizer is None:  # the default, byte-level
        return Tokens(_stdlib_bytes(max_bytes), eval_fraction=eval_fraction, source=STDLIB)
    files = stdlib_files() if path is None else text_files(path)
    if path is not None:
        from zjax.data._plaintext import check_text_files

        check_text_files(path, files, key="data.path")  # a .csv or a .jsonl.bz2 is not text
    sizes = _sizes(files, path)
    source = STDLIB if path is None else str(path)
    if tokenizer is not None:
        from zjax.data._tokenizer import load_tokenizer

        ids = _encode(load_tokenizer(tokenizer), _text_pieces(files, max_bytes))
        return Tokens(ids, eval_fraction=eval_fraction, source=source)
    return Tokens(_byte_stream(files, sizes, max_bytes), eval_fraction=eval_fraction,
                  source=source)


def _sizes(files: list[Path], path: str | None) -> list[int]:
    sizes = []
    for f in files:
        try:
            sizes.append(f.stat().st_size)
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {str(f)!r}: {e.strerror}") from None
    if sum(sizes) == 0:
        raise ConfigError(f"data.path: {path!r} holds no data (all files are empty)")
    return sizes


@functools.lru_cache(maxsize=2)
def _stdlib_bytes(max_bytes: int | None) -> np.ndarray:
    """The standard library's bytes, read once per process (about 30 MB, kept: a run reads
    them for its training and its evaluation, a test process for many runs), read-only."""
    files = stdlib_files()
    out = _byte_stream(files, _sizes(files, None), max_bytes)
    out.flags.writeable = False
    return out


def _token_array(path: str) -> np.ndarray:
    """A ``.npy`` of token ids, memory-mapped and checked."""
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path: cannot read token array {path!r}: {e}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"data.path: {path!r} holds {arr.dtype}, expected integer tokens")
    if arr.ndim != 1:
        what = ("a single number (a 0-d array)" if arr.ndim == 0
                else f"an array of shape {arr.shape}")
        raise ConfigError(f"data.path: {path!r} holds {what}, expected a flat (1-d) array "
                          "of token ids")
    if len(arr) == 0:
        raise ConfigError(f"data.path: {path!r} is empty")
    _check_ids(arr, path)
    return arr


def _byte_stream(files: list[Path], sizes: list[int], max_bytes: int | None) -> np.ndarray:
    """Every byte of ``files``, joined by newlines: one file memory-mapped, several read
    into one array."""
    total = sum(sizes) + len(files) - 1
    if len(files) == 1 and max_bytes is None:
        try:
            return np.memmap(files[0], dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ConfigError(f"data.path: cannot read {str(files[0])!r}: {e}") from None
    out = np.empty(total if max_bytes is None else min(total, max_bytes), np.uint8)
    at = 0
    for f, size in zip(files, sizes, strict=True):
        if at >= len(out):
            break  # only with max_bytes: the sample asked for
        if at:
            out[at], at = ord("\n"), at + 1
        want = min(size, len(out) - at)
        try:
            with open(f, "rb") as fh:
                got = fh.readinto(memoryview(out)[at:at + want])
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {str(f)!r}: {e.strerror}") from None
        if got != want:
            raise ConfigError(f"data.path: {str(f)!r} changed while it was read ({size} bytes "
                              f"when listed, {got} read)")
        at += want
    return out[:at]


_PIECE = 1 << 20  # characters of text per encode (cut at a line end), for parallel encoding


def _text_pieces(files: list[Path], max_bytes: int | None) -> Iterator[str]:
    """The text of ``files`` joined by newlines (undecodable bytes replaced), in pieces of
    about ``_PIECE`` characters cut after a newline."""
    left = max_bytes
    for k, f in enumerate(files):
        if left is not None and left <= 0:
            return
        carry = "\n" if k else ""
        try:
            with open(f, "rb") as fh:
                text = io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline="")
                while chunk := text.read(_PIECE):
                    if left is not None:
                        chunk, left = chunk[:left], left - len(chunk)
                    carry += chunk
                    cut = carry.rfind("\n") + 1
                    if cut:
                        yield carry[:cut]
                        carry = carry[cut:]
                    elif len(carry) >= 4 * _PIECE:  # no line end for a long way
                        yield carry
                        carry = ""
                    if left is not None and left <= 0:
                        break
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {str(f)!r}: {e.strerror}") from None
        if carry:
            yield carry


def _encode(tokenizer, pieces: Iterator[str]) -> np.ndarray:
    """The ids of ``pieces``, in order, as int32 (encoded in parallel groups)."""
    out, group = [], []
    for piece in itertools.chain(pieces, [None]):
        if piece is not None:
            group.append(piece)
        if group and (piece is None or len(group) == _GROUP):
            for enc in tokenizer.encode_batch(group, add_special_tokens=False):
                out.append(np.asarray(enc.ids, np.int32))
            group = []
    ids = np.concatenate(out) if out else np.zeros(0, np.int32)
    if len(ids) == 0:
        raise ConfigError("data.path: the text encodes to no token")
    return ids


_GROUP = 16  # pieces per encode_batch call


def _check_ids(arr: np.ndarray, path: str) -> None:
    """Token ids must be >= 0 and fit the int32 batches (or they would wrap silently)."""
    limit = np.iinfo(np.int32).max
    for bad, what in ((arr.min(), "negative"), (arr.max(), f"above {limit} (int32)")):
        if bad < 0 or bad > limit:
            where = int(np.argmin(arr) if bad < 0 else np.argmax(arr))
            raise ConfigError(f"data.path: {path!r} holds the token id {int(bad)} (at index "
                              f"{where}), which is {what}; token ids must be in "
                              "[0, model.vocab_size)")


class _Windows:
    """Non-overlapping ``seq_len + 1`` windows (inputs and shifted targets) of a stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


def window_batches(tokens: np.ndarray, *, global_batch: int, seq_len: int, seed: int,
                   process_index: int = 0, process_count: int = 1,
                   split: str = "train") -> grain.DatasetIterator | None:
    """A checkpointable iterator of this process's ``[global_batch / processes, seq_len + 1]``.

    Windows are reshuffled every epoch from ``seed``; process ``p`` takes every
    ``process_count``-th window starting at ``p``, so the processes' slices of a global batch
    are disjoint and together form it.

    An ``eval`` split shorter than one batch of windows is one batch of dicts (``tokens`` and
    ``loss_mask``): its windows (the last one partial), then padding whose loss mask is 0, so
    it adds nothing to the loss. One with fewer than 2 tokens gives None (no evaluation) and
    logs a warning. Only a ``train`` split too short for one batch is refused.
    """
    if global_batch % process_count:
        raise ConfigError(
            f"data.batch_size: {global_batch} is not divisible by the {process_count} processes"
        )
    windows = _Windows(tokens, seq_len)
    if len(windows) < global_batch and split == "eval":
        return _short_eval(tokens, seq_len=seq_len, global_batch=global_batch,
                           process_index=process_index, process_count=process_count)
    if len(windows) < global_batch:
        raise ConfigError(
            f"data.batch_size: {global_batch}, but the {split} split ({len(tokens)} tokens) "
            f"holds {len(windows)} windows of {seq_len + 1} (data.seq_len {seq_len} + 1), "
            "fewer than one batch; lower data.batch_size or data.seq_len, or add data"
        )
    ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(global_batch // process_count, drop_remainder=True)
    return iter(ds.to_iter_dataset())


class _MaskedWindows:
    """The windows of a short stream, the last one partial, as ``tokens`` and ``loss_mask``
    (1 on the window's tokens, 0 on the zeros that fill a partial one)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = -(-(len(tokens) - 1) // seq_len) if len(tokens) > 1 else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start = int(i) * self.seq_len
        real = np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)
        pad = self.seq_len + 1 - len(real)
        return {"tokens": np.pad(real, (0, pad)),
                "loss_mask": np.pad(np.ones(len(real), np.int32), (0, pad))}


def _short_eval(tokens: np.ndarray, *, seq_len: int, global_batch: int, process_index: int,
                process_count: int) -> grain.DatasetIterator | None:
    from zjax.data._packing import PaddedWindows, padded_batches

    windows = _MaskedWindows(tokens, seq_len)
    if len(windows) == 0:
        logging.getLogger("zjax").warning(
            "data.eval_fraction: the eval split holds %d tokens, no window to evaluate on; "
            "training without evaluation (raise data.eval_fraction, or set "
            "train.eval_every=0)", len(tokens))
        return None
    rows = PaddedWindows([windows], global_batch, seq_len, ("tokens", "loss_mask"))
    return padded_batches(rows, process_index=process_index, process_count=process_count)
