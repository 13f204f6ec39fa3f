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
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

import grain
import numpy as np

from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["BYTE_VOCAB", "DataConfig", "Tokens", "load_tokens", "stdlib_files", "text_files",
           "window_batches"]

BYTE_VOCAB = 256


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this Python's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def text_files(path: str, *, key: str = "data.path") -> list[Path]:
    """The files of a text file, a directory (all files under it) or a glob, sorted."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        if not files:
            raise ConfigError(f"{key}: directory {path!r} holds no file")
        return files
    if p.is_file():
        return [p]
    files = sorted(Path(f) for f in glob.glob(os.fspath(path), recursive=True) if Path(f).is_file())
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
        self.vocab_size = int(tokens.max()) + 1 if len(tokens) else 0
        if tokens.dtype == np.uint8:
            self.vocab_size = BYTE_VOCAB

    def split(self, name: str) -> np.ndarray:
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        return self.train if name == "train" else self.eval


def load_tokens(path: str | None = None, *, eval_fraction: float = 0.05,
                max_bytes: int | None = 64 * 2**20, tokenizer: str | None = None) -> Tokens:
    """Read the token stream of ``data.path`` (see the module docstring for the sources).

    ``tokenizer``: a ``tokenizer.json`` that text sources are encoded with (byte-level
    without); the stream's vocabulary is then the tokenizer's.
    """
    tokens = _load_tokens(path, eval_fraction=eval_fraction, max_bytes=max_bytes,
                          tokenizer=tokenizer)
    if tokenizer is not None:
        from zjax.data._tokenizer import id_bound, load_tokenizer

        tokens.vocab_size = max(tokens.vocab_size, id_bound(load_tokenizer(tokenizer)))
    return tokens


def _load_tokens(path: str | None, *, eval_fraction: float, max_bytes: int | None,
                 tokenizer: str | None) -> Tokens:
    if path is not None and str(path).endswith(".npy") and Path(path).is_file():
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
        _check_ids(arr, str(path))
        return Tokens(arr, eval_fraction=eval_fraction, source=str(path))
    files = stdlib_files() if path is None else text_files(path)
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {str(f)!r}: {e}") from None
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if total == 0:
        raise ConfigError(f"data.path: {path!r} holds no data (all files are empty)")
    source = "the Python standard library" if path is None else str(path)
    if tokenizer is not None:
        from zjax.data._tokenizer import load_tokenizer

        text = b"\n".join(chunks).decode("utf-8", errors="replace")
        ids = load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids
        return Tokens(np.asarray(ids, np.int32), eval_fraction=eval_fraction, source=source)
    tokens = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    return Tokens(tokens, eval_fraction=eval_fraction, source=source)


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
                   split: str = "train") -> grain.DatasetIterator:
    """A checkpointable iterator of this process's ``[global_batch / processes, seq_len + 1]``.

    Windows are reshuffled every epoch from ``seed``; process ``p`` takes every
    ``process_count``-th window starting at ``p``, so the processes' slices of a global batch
    are disjoint and together form it.
    """
    if global_batch % process_count:
        raise ConfigError(
            f"data.batch_size: {global_batch} is not divisible by the {process_count} processes"
        )
    windows = _Windows(tokens, seq_len)
    if len(windows) < global_batch and split == "eval":
        raise ConfigError(
            f"data.eval_fraction: the eval split ({len(tokens)} tokens) holds {len(windows)} "
            f"windows of {seq_len + 1}, fewer than one batch of {global_batch}; raise "
            "data.eval_fraction, or set train.eval_every=0"
        )
    if len(windows) < global_batch:
        raise ConfigError(
            f"data.seq_len: the {split} split ({len(tokens)} tokens) holds {len(windows)} "
            f"windows of {seq_len + 1}, fewer than one batch of {global_batch}"
        )
    ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(global_batch // process_count, drop_remainder=True)
    return iter(ds.to_iter_dataset())
