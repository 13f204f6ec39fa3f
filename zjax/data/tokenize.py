"""Text to token ids with a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

``zjax tokenize INPUTS -o OUT.npy --tokenizer tokenizer.json`` writes one flat ``.npy`` array of
token ids that training memory-maps (``data.path: OUT.npy``); ``data.tokenizer`` tokenizes a
text ``data.path`` as it is read instead. Files are encoded in batches by the tokenizer's own
threads (Rust, all cores); the ids of consecutive files are concatenated, in the order given.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from zjax.errors import ConfigError

__all__ = ["check_fits", "encode_files", "id_bound", "load_tokenizer", "tokenize_files"]


def load_tokenizer(path: str | os.PathLike, *, key: str = "data.tokenizer"):
    """The ``tokenizers.Tokenizer`` saved at ``path`` (a ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise ConfigError(f"{key}: {str(path)!r} is not a file (expected a tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own parse error, one line
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ConfigError(f"{key}: {str(path)!r} is not a tokenizer.json the tokenizers "
                          f"library reads: {why}") from None


def id_bound(tokenizer) -> int:
    """One past the largest id ``tokenizer`` can produce (added tokens included; a
    vocabulary's ids need not be contiguous)."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def check_fits(tokenizer, vocab_size: int, *, tokenizer_path: str | os.PathLike,
               model: str) -> None:
    """Refuse a tokenizer whose ids do not all have a row in the model's embedding.

    Raises:
      ConfigError: naming the tokenizer file, its largest id and the model's vocabulary.
    """
    bound = id_bound(tokenizer)
    if bound > vocab_size:
        raise ConfigError(
            f"{tokenizer_path}: the tokenizer has token ids up to {bound - 1}, but {model} has "
            f"a vocabulary of {vocab_size} (ids 0..{vocab_size - 1}): not this model's "
            "tokenizer (its ids past the vocabulary would have no embedding)")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"tokenize: cannot read {str(path)!r}: {e.strerror}") from None


def encode_files(tokenizer, files: Sequence[Path], *, batch: int = 64,
                 progress: Callable[[int], None] | None = None) -> Iterator[np.ndarray]:
    """The token ids of each file, in order (``batch`` files per parallel encode call)."""
    for start in range(0, len(files), batch):
        group = files[start:start + batch]
        for enc in tokenizer.encode_batch([_read(f) for f in group],
                                          add_special_tokens=False):
            yield np.asarray(enc.ids, dtype=np.int64)
        if progress is not None:
            progress(len(group))


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_files(files: Sequence[Path], out: str | os.PathLike, *, tokenizer_path: str,
                   progress: Callable[[int], None] | None = None) -> dict:
    """Write the token ids of ``files`` to ``out`` (a ``.npy``, written whole or not at all).

    Returns:
      ``{"tokens": count, "files": count, "vocab_size": n, "dtype": name}``.
    """
    tokenizer = load_tokenizer(tokenizer_path, key="--tokenizer")
    dtype = _dtype(tokenizer.get_vocab_size())
    out = Path(out)
    if out.suffix != ".npy":
        raise ConfigError(f"-o: {str(out)!r}: expected a .npy file name")
    if out.exists():
        raise ConfigError(f"-o: {str(out)!r} already exists; zjax does not replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    # the count is known only at the end: ids go to a raw file first, then into the .npy
    with tempfile.TemporaryFile(dir=out.parent) as raw:
        for ids in encode_files(tokenizer, files, progress=progress):
            raw.write(ids.astype(dtype).tobytes())
            total += len(ids)
        if total == 0:
            raise ConfigError("tokenize: the inputs hold no text")
        tmp = out.with_name(f".{out.name}.partial")
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
        raw.seek(0)
        done, chunk = 0, 1 << 22
        while done < total:
            part = np.frombuffer(raw.read(chunk * dtype.itemsize), dtype=dtype)
            arr[done:done + len(part)] = part
            done += len(part)
        arr.flush()
        del arr
        os.replace(tmp, out)
    return {"tokens": total, "files": len(files), "vocab_size": tokenizer.get_vocab_size(),
            "dtype": dtype.name}
