"""Text to token ids with a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

``zjax tokenize INPUTS -o OUT.npy --tokenizer tokenizer.json`` writes the text files' ids as
one flat ``.npy`` stream that training memory-maps (``data.path: OUT.npy``); with ``-o OUT``
(a directory) it writes documents (records, or one per text file) with their loss masks
(:func:`tokenize_records`), which training reads as it reads the records themselves.
``data.tokenizer`` tokenizes a ``data.path`` as it is read instead. Files are encoded in
batches by the tokenizer's own threads (Rust, all cores), in the order given.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from zjax.data._documents import Encoder
from zjax.data._pipeline import text_files
from zjax.data._sources import record_files, rows, source_kind
from zjax.data._store import fill_from, token_dtype, write_store
from zjax.data._tokenizer import check_fits, id_bound, load_tokenizer
from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["check_fits", "encode_files", "id_bound", "load_tokenizer", "tokenize_files",
           "tokenize_records"]


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


def tokenize_files(files: Sequence[Path], out: str | os.PathLike, *, tokenizer_path: str,
                   progress: Callable[[int], None] | None = None) -> dict:
    """Write the token ids of ``files`` to ``out`` (a ``.npy``, written whole or not at all).

    Returns:
      ``{"tokens": count, "files": count, "vocab_size": n, "dtype": name}``.
    """
    tokenizer = load_tokenizer(tokenizer_path, key="--tokenizer")
    dtype = token_dtype(tokenizer.get_vocab_size())
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
        fill_from(raw, arr)
        del arr
        os.replace(tmp, out)
    return {"tokens": total, "files": len(files), "vocab_size": tokenizer.get_vocab_size(),
            "dtype": dtype.name}


def _text_rows(files: Sequence[Path], field: str):
    for f in files:
        yield str(f), {field: _read(f)}


def tokenize_records(inputs: Sequence[str], out: str | os.PathLike, *, data: DataConfig,
                     progress: Callable[[int], None] | None = None, workers: int = 1) -> dict:
    """Write the documents of ``inputs`` (record files, or text files: one document each) as a
    ``zjax tokenize`` directory (:mod:`zjax.data._store`), encoded as ``data`` says.

    ``workers`` > 1 encodes in that many processes (the same bytes; for chat templates,
    which render in Python).

    Returns:
      The directory's metadata: ``documents``, ``tokens``, ``loss_tokens``, ``vocab_size``...
    """
    kind = source_kind(list(inputs), key="tokenize")
    if kind == "store":
        raise ConfigError("tokenize: the inputs are already a zjax tokenize directory")
    if kind == "stream" and data.format != "text":
        raise ConfigError(f"--format: {data.format} needs records (.jsonl, .parquet, .arrow)")
    encoder = Encoder(data)
    found = (rows(record_files(list(inputs), key="tokenize"), encoder.columns)
             if kind == "records"
             else _text_rows([f for i in inputs for f in text_files(i, key="tokenize")],
                             encoder.columns[0]))
    if workers > 1:
        from zjax.data._parallel import encode_in_parallel

        docs = encode_in_parallel(data, found, workers=workers)
    else:
        docs = encoder.documents(found)
    return write_store(out, docs, vocab_size=encoder.vocab_size, meta=encoder.meta,
                       progress=progress)
