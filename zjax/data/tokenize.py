"""Text to token ids with a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

``zjax tokenize INPUTS -o OUT`` (a directory) writes documents (records, or one per text file)
with their loss masks (:func:`tokenize_records`), which training reads as it reads the records
themselves. ``-o OUT.npy`` writes one flat ``.npy`` stream of ids that training memory-maps
(``data.path: OUT.npy``): of text files, their ids end to end (:func:`tokenize_files`); of
``text`` records, each record's ids as training on the records encodes them (the tokenizer's
special tokens, then the EOS), end to end. A flat stream has no loss mask, so records of
``chat`` or ``prompt_completion`` (whose prompts are not trained on) are refused there: they
need a directory (``preference`` records too: a pair's two sequences are its documents
``2k`` and ``2k + 1``, cut to ``data.seq_len`` as they are encoded, so training checks that
its ``seq_len`` and ``max_prompt_len`` are the directory's). ``data.tokenizer`` tokenizes a
``data.path`` as it is read instead. Files are encoded in batches by the tokenizer's own
threads (Rust, all cores), in the order given.

Every output records its tokenizer (:mod:`zjax.data._store`: a directory's
``zjax-tokens.json``, a ``.npy``'s ``OUT.npy.zjax-tokens.json``) and appears whole or not at
all: a failed, interrupted or killed run leaves no partial output that a later one reads.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from zjax.data._documents import Encoder
from zjax.data._pipeline import text_files
from zjax.data._plaintext import check_text_files
from zjax.data._sources import record_files, rows, source_kind
from zjax.data._store import (
    fill_from,
    is_partial,
    new_output,
    partial_path,
    token_dtype,
    write_error,
    write_npy_meta,
    write_store,
)
from zjax.data._tokenizer import check_fits, id_bound, load_tokenizer, tokenizer_identity
from zjax.data.config import DataConfig
from zjax.errors import ConfigError
from zjax.runtime.stop import stop_point

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


def _npy_output(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.suffix != ".npy":  # (data.path reads a .npy, in lower case, as token ids)
        raise ConfigError(f"-o: {str(out)!r}: expected a .npy file name (in lower case)")
    return new_output(out)


def _write_flat(out: Path, ids: Iterable[np.ndarray], dtype: np.dtype, meta: dict) -> int:
    """Write the arrays ``ids`` end to end as the ``.npy`` ``out`` (and its record), whole or
    not at all. Returns the number of ids."""
    total = 0
    tmp = partial_path(out, directory=False)
    try:
        # the count is known only at the end: ids go to a raw file first, then into the .npy
        with tempfile.TemporaryFile(dir=out.parent) as raw:
            for part in ids:
                raw.write(part.astype(dtype).tobytes())
                total += len(part)
            if total == 0:
                raise ConfigError("tokenize: the inputs hold no text")
            arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
            raw.seek(0)
            fill_from(raw, arr)
            del arr
        stop_point()  # a stop that arrived unseen (zjax.runtime.stop) still leaves nothing
        write_npy_meta(out, {**meta, "tokens": total, "dtype": dtype.name})
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(out, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return total


def tokenize_files(files: Sequence[Path], out: str | os.PathLike, *, tokenizer_path: str,
                   progress: Callable[[int], None] | None = None) -> dict:
    """Write the token ids of the text ``files`` to ``out`` (a ``.npy``, written whole or not
    at all, with its record ``OUT.npy.zjax-tokens.json``).

    Returns:
      ``{"tokens": count, "files": count, "vocab_size": n, "dtype": name}``.

    Raises:
      ConfigError: a file that is not text (a record, compressed or binary file: its bytes
        would become the tokens), an output that exists or cannot be written.
    """
    check_text_files(None, files, key="tokenize")
    return _text_stream(files, out, tokenizer_path, progress)


def _checked_text_files(inputs: Sequence[str]) -> list[Path]:
    """The text files of ``inputs``, each checked (:mod:`zjax.data._plaintext`)."""
    files = []
    for item in inputs:
        found = [f for f in text_files(item, key="tokenize") if not is_partial(f)]
        check_text_files(item, found, key="tokenize")
        files += found
    return files


def _text_stream(files: Sequence[Path], out, tokenizer_path: str, progress) -> dict:
    tokenizer = load_tokenizer(tokenizer_path, key="--tokenizer")
    dtype = token_dtype(id_bound(tokenizer))
    out = _npy_output(out)
    meta = {"format": "text", "inputs": "text files", "files": len(files),
            "tokenizer": str(tokenizer_path),
            "tokenizer_id": tokenizer_identity(tokenizer, tokenizer_path, eos_id=None)}
    total = _write_flat(out, encode_files(tokenizer, files, progress=progress), dtype, meta)
    return {"tokens": total, "files": len(files), "vocab_size": tokenizer.get_vocab_size(),
            "dtype": dtype.name}


def _text_rows(files: Sequence[Path], field: str):
    for f in files:
        yield str(f), {field: _read(f)}


def _flat_records(docs, out: Path, encoder: Encoder, progress) -> dict:
    """``text`` records' documents end to end as the ``.npy`` ``out``."""
    n = 0

    def ids():
        nonlocal n
        for i, _ in docs:
            n += 1
            if progress is not None:
                progress(1)
            yield i

    dtype = token_dtype(encoder.vocab_size)
    total = _write_flat(out, ids(), dtype, {**encoder.meta, "inputs": "records"})
    return {**encoder.meta, "documents": n, "tokens": total, "loss_tokens": total,
            "vocab_size": encoder.vocab_size, "dtype": dtype.name}


def tokenize_records(inputs: Sequence[str], out: str | os.PathLike, *, data: DataConfig,
                     progress: Callable[[int], None] | None = None, workers: int = 1) -> dict:
    """Write the documents of ``inputs`` (record files, or text files: one document each) as a
    ``zjax tokenize`` directory (:mod:`zjax.data._store`), encoded as ``data`` says; with
    ``out`` a ``.npy``, as one flat stream (the module docstring says which inputs may be).

    ``workers`` > 1 encodes in that many processes (the same bytes; for chat templates,
    which render in Python).

    Returns:
      The output's metadata: ``documents``, ``tokens``, ``loss_tokens``, ``vocab_size``...
    """
    kind = source_kind(list(inputs), key="tokenize")
    if kind == "store":
        raise ConfigError("tokenize: the inputs are already a zjax tokenize directory")
    if kind == "stream" and data.format != "text":
        raise ConfigError(f"--format: {data.format} needs records (.jsonl, .parquet, .arrow)")
    flat = str(out).lower().endswith(".npy")
    if flat and kind == "stream":
        return _text_stream(_checked_text_files(inputs), out, data.tokenizer, progress)
    if flat and data.format != "text":
        raise ConfigError(
            f"-o: {str(out)!r}: a flat .npy of ids has no loss mask, so the {data.format} "
            "records' prompts would be trained on (and no document boundary kept); write a "
            f"directory instead: -o {str(out)[:-4]} (train with data.path set to it)")
    encoder = Encoder(data)
    if kind == "records":
        found = rows(record_files(list(inputs), key="tokenize"), encoder.columns,
                     optional=encoder.optional)
    else:
        found = _text_rows(_checked_text_files(inputs), encoder.columns[0])
    out = _npy_output(out) if flat else new_output(out)
    with contextlib.closing(_documents(encoder, data, found, workers)) as docs:
        if flat:
            return _flat_records(docs, out, encoder, progress)
        return write_store(out, docs, vocab_size=encoder.vocab_size, meta=encoder.meta,
                           progress=progress)


def _documents(encoder: Encoder, data: DataConfig, found, workers: int):
    if workers > 1:
        from zjax.data._parallel import encode_in_parallel

        encoder.reset()
        yield from encode_in_parallel(data, found, workers=workers, stats=encoder.stats)
        encoder.report(source="tokenize")
    else:
        yield from encoder.documents(found, source="tokenize")
