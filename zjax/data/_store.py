"""Documents as flat arrays: every document's token ids end to end, its loss mask alongside,
and the offsets where each document starts.

Built in memory from a source's rows (training on an untokenized source), or written once to a
directory by ``zjax tokenize`` and memory-mapped from there (a corpus larger than memory):

    OUT/tokens.npy      token ids (uint16 or uint32, by the vocabulary)
    OUT/loss_mask.npy   uint8, 1 where the token is trained on
    OUT/offsets.npy     int64, documents + 1 entries; document i is [offsets[i], offsets[i+1])
    OUT/zjax-tokens.json  what made it (format, tokenizer, counts)

Both are built by the same encoder from the same rows, so they hold the same arrays.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from zjax.data._sources import STORE_META
from zjax.errors import ConfigError

__all__ = ["Documents", "build_documents", "fill_from", "read_store", "token_dtype",
           "write_store"]

_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Documents:
    """Documents end to end.

    Attributes:
      tokens: int ``[N]`` token ids.
      loss_mask: uint8 ``[N]``.
      offsets: int64 ``[documents + 1]``.
      vocab_size: one past the largest id the tokenizer can produce.
      source: what they came from, for messages.
      meta: how they were made (format, train_on_prompt, tokenizer).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    vocab_size: int
    source: str
    meta: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, start: int, stop: int) -> Documents:
        """Documents ``start..stop`` (the arrays are shared, not copied)."""
        return dataclasses.replace(self, offsets=self.offsets[start:stop + 1])


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def build_documents(docs: Iterable[tuple[np.ndarray, np.ndarray]], *, vocab_size: int,
                    source: str, meta: dict) -> Documents:
    """The documents of ``docs`` (``(ids, mask)`` pairs) in memory."""
    ids, masks, lengths = [], [], [0]
    for i, m in docs:
        ids.append(i)
        masks.append(m)
        lengths.append(len(i))
    if len(ids) == 0:
        raise ConfigError(f"data.path: {source} holds no records")
    tokens = np.concatenate(ids).astype(token_dtype(vocab_size))
    return Documents(tokens, np.concatenate(masks), np.cumsum(lengths, dtype=np.int64),
                     vocab_size, source, meta)


def write_store(out: str | os.PathLike, docs: Iterable[tuple[np.ndarray, np.ndarray]], *,
                vocab_size: int, meta: dict,
                progress: Callable[[int], None] | None = None) -> dict:
    """Write ``docs`` to the directory ``out``, whole or not at all (built beside it and
    renamed). Returns the metadata written (counts included)."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"-o: {str(out)!r} already exists; zjax does not replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        counts = _spool(tmp, docs, token_dtype(vocab_size), progress)
        meta = {**meta, **counts, "vocab_size": vocab_size, "version": _VERSION}
        (tmp / STORE_META).write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _spool(tmp: Path, docs, dtype: np.dtype, progress) -> dict:
    """Stream ``docs`` into raw files, then into the three ``.npy`` arrays."""
    n_docs = n_tokens = n_loss = 0
    with (open(tmp / "tokens.raw", "wb") as tok, open(tmp / "mask.raw", "wb") as msk,
          open(tmp / "lengths.raw", "wb") as lens):
        for ids, mask in docs:
            tok.write(ids.astype(dtype).tobytes())
            msk.write(mask.astype(np.uint8).tobytes())
            lens.write(np.int64(len(ids)).tobytes())
            n_docs, n_tokens, n_loss = n_docs + 1, n_tokens + len(ids), n_loss + int(mask.sum())
            if progress is not None:
                progress(1)
    if n_docs == 0:
        raise ConfigError("tokenize: the inputs hold no records")
    _to_npy(tmp / "tokens.raw", tmp / "tokens.npy", dtype, n_tokens)
    _to_npy(tmp / "mask.raw", tmp / "loss_mask.npy", np.dtype(np.uint8), n_tokens)
    lengths = np.fromfile(tmp / "lengths.raw", np.int64)
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    (tmp / "lengths.raw").unlink()
    return {"documents": n_docs, "tokens": n_tokens, "loss_tokens": n_loss,
            "dtype": dtype.name}


def fill_from(raw, arr: np.ndarray) -> None:
    """Fill ``arr`` (a memory-mapped ``.npy``) from the binary file ``raw``, 4M items at a
    time."""
    done, chunk = 0, 1 << 22
    while done < len(arr):
        part = np.frombuffer(raw.read(chunk * arr.dtype.itemsize), dtype=arr.dtype)
        arr[done:done + len(part)] = part
        done += len(part)
    arr.flush()


def _to_npy(raw: Path, out: Path, dtype: np.dtype, n: int) -> None:
    arr = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(n,))
    with open(raw, "rb") as f:
        fill_from(f, arr)
    del arr
    raw.unlink()


def read_store(path: str | os.PathLike) -> Documents:
    """The documents of a ``zjax tokenize`` directory, memory-mapped."""
    path = Path(path)
    try:
        meta = json.loads((path / STORE_META).read_text())
        arrays = [np.load(path / f"{name}.npy", mmap_mode="r")
                  for name in ("tokens", "loss_mask", "offsets")]
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.path: {str(path)!r} is not a readable zjax tokenize "
                          f"directory: {e}") from None
    tokens, mask, offsets = arrays
    if len(tokens) != len(mask) or offsets[-1] != len(tokens) or len(offsets) < 2:
        raise ConfigError(f"data.path: {str(path)!r}: tokens.npy, loss_mask.npy and "
                          "offsets.npy disagree (a damaged or partial zjax tokenize output)")
    return Documents(tokens, mask, offsets, int(meta.get("vocab_size", 0)), str(path), meta)
