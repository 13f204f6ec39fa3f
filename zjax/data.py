"""Byte-level text data: a corpus of files, a held-out split, deterministic batches.

The default corpus is the ``.py`` files of Python's own standard library, present on every
machine. Batch ``i`` depends only on ``(seed, i)``, so the iterator's state is the step number
and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from zjax.errors import ConfigError

__all__ = ["TextData", "load_text", "stdlib_files"]

VOCAB_SIZE = 256  # bytes


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this Python's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def _files(path: str | None) -> list[Path]:
    if path is None:
        return stdlib_files()
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(os.fspath(path), recursive=True))
    if not files:
        raise ConfigError(
            f"data.path: {path!r} matches no file (give a file, a directory or a glob)"
        )
    return files


@dataclasses.dataclass(frozen=True)
class TextData:
    """Byte tokens split into train and eval parts."""

    train: np.ndarray
    eval: np.ndarray

    def batches(self, *, batch_size: int, seq_len: int, seed: int, split: str = "train",
                start: int = 0) -> Iterator[np.ndarray]:
        """Yield int32 batches ``[batch_size, seq_len + 1]`` of random windows from ``start``."""
        tokens = self.train if split == "train" else self.eval
        span = len(tokens) - seq_len - 1
        if span <= 0:
            raise ConfigError(
                f"data.seq_len: {seq_len} is longer than the {split} split ({len(tokens)} tokens)"
            )
        step = start
        while True:
            rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
            offsets = rng.integers(0, span, batch_size)
            yield np.stack([tokens[o:o + seq_len + 1] for o in offsets]).astype(np.int32)
            step += 1


def load_text(path: str | None = None, *, eval_fraction: float = 0.05,
              max_bytes: int | None = 64 * 2**20) -> TextData:
    """Read files as bytes; the last ``eval_fraction`` of the stream is held out for eval."""
    chunks, total = [], 0
    for f in _files(path):
        try:
            data = f.read_bytes()
        except OSError as e:
            raise ConfigError(f"data.path: cannot read {str(f)!r}: {e}") from None
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    tokens = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
    n_eval = int(len(tokens) * eval_fraction)
    return TextData(train=tokens[: len(tokens) - n_eval], eval=tokens[len(tokens) - n_eval:])
