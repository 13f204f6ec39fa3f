"""Record sources: which files a ``data.path`` names, and their rows, one at a time.

A source is a file, a directory or a glob (or a list of them). By extension a file holds
records (JSON lines, optionally gzip or zstd compressed; Parquet; Arrow IPC, as
``datasets.save_to_disk`` writes), a ``zjax tokenize`` store (a directory), or text. Rows are
read streaming (Parquet and Arrow by record batch, memory-mapped; JSON lines by line), so a
source larger than memory is read in one pass. Each row comes with where it is
(``FILE, row N``), for the errors.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from zjax.errors import ConfigError

__all__ = ["STORE_META", "is_record_file", "object_rows", "record_files", "rows", "source_kind"]

STORE_META = "zjax-tokens.json"  # marks a zjax tokenize directory
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
_RECORDS = (*_JSONL, ".parquet", ".arrow")
_BATCH = 1024  # Parquet and Arrow rows decoded at a time


def is_record_file(path: Path) -> bool:
    return path.name.lower().endswith(_RECORDS)


def _is_hf_dir(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _expand(item: str, key: str) -> list[Path]:
    p = Path(item)
    if p.is_dir():
        if (p / STORE_META).is_file() or _is_hf_dir(p):
            return [p]
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        if not files:
            raise ConfigError(f"{key}: directory {item!r} holds no file")
        return files
    if p.is_file():
        return [p]
    found = sorted(Path(f) for f in glob.glob(os.fspath(item), recursive=True))
    if not found:
        raise ConfigError(f"{key}: {item!r} does not exist and matches no file as a glob")
    return found


def source_kind(spec: str | Sequence[str] | None, *, key: str = "data.path") -> str:
    """``records``, ``store`` (a ``zjax tokenize`` directory) or ``stream`` (text, ``.npy``,
    or the standard library when ``spec`` is None)."""
    if spec is None:
        return "stream"
    items = [spec] if isinstance(spec, str) else list(spec)
    kinds = set()
    for item in items:
        for f in _expand(item, key):
            if f.is_dir() and (f / STORE_META).is_file():
                kinds.add("store")
            elif f.is_dir() or is_record_file(f):
                kinds.add("records")
            else:
                kinds.add("stream")
    if len(kinds) > 1:
        raise ConfigError(f"{key}: {spec!r} mixes {' and '.join(sorted(kinds))} (records are "
                          ".jsonl/.parquet/.arrow; a text or .npy source is a token stream); "
                          "give them as separate sources of a {path: weight} mapping")
    if kinds == {"store"} and len(items) > 1:
        raise ConfigError(f"{key}: one zjax tokenize directory per source; mix several with "
                          "a {path: weight} mapping")
    return kinds.pop()


def record_files(spec: str | Sequence[str], *, key: str = "data.path") -> list[Path]:
    """The record files (and dataset directories) of a source, in order."""
    items = [spec] if isinstance(spec, str) else list(spec)
    return [f for item in items for f in _expand(item, key)]


def rows(files: Sequence[Path], columns: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row of ``files`` in order; ``row`` holds ``columns``.

    Raises:
      ConfigError: a file that cannot be read, a row that is not a JSON object, a missing
        column; each names the file (and row).
    """
    for f in files:
        if f.is_dir():
            yield from _dataset_dir(f, columns)
        elif f.name.lower().endswith(_JSONL):
            yield from _jsonl(f, columns)
        elif f.name.lower().endswith(".parquet"):
            yield from _parquet(f, columns)
        else:
            yield from _arrow(f, columns)


def _opened(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    raw = open(path, "rb")  # noqa: SIM115 - closed by the wrapper
    if name.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    elif name.endswith(".zst"):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict")


def _jsonl(path: Path, columns: Sequence[str]) -> Iterator[tuple[str, dict]]:
    try:
        with _opened(path) as lines:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{path}, row {n}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno}); each "
                                      "line of a .jsonl file is one JSON object") from None
                yield where, _pick(row, columns, where)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise ConfigError(f"data.path: cannot read {str(path)!r}: {e}") from None


def _pick(row: Any, columns: Sequence[str], where: str) -> dict:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with {_names(columns)}, got "
                          f"{type(row).__name__}")
    for c in columns:
        if row.get(c) is None:
            have = ", ".join(map(repr, sorted(row))) or "none"
            raise ConfigError(f"{where}: no field {c!r} (fields: {have})")
    return row


def _names(columns: Sequence[str]) -> str:
    return " and ".join(repr(c) for c in columns)


def _table_rows(batches, schema_names, columns, path: Path) -> Iterator[tuple[str, dict]]:
    missing = [c for c in columns if c not in schema_names]
    if missing:
        raise ConfigError(f"{path}: no column {missing[0]!r} (columns: "
                          f"{', '.join(map(repr, schema_names))})")
    n = 0
    for batch in batches:
        for row in batch.select(list(columns)).to_pylist():
            n += 1
            yield f"{path}, row {n}", _pick(row, columns, f"{path}, row {n}")


def _parquet(path: Path, columns: Sequence[str]) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, memory_map=True)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"data.path: cannot read {str(path)!r} as Parquet: {e}") from None
    names = pf.schema_arrow.names
    have = [c for c in columns if c in names]
    yield from _table_rows(pf.iter_batches(batch_size=_BATCH, columns=have or None),
                           names, columns, path)


def _arrow(path: Path, columns: Sequence[str]) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)  # datasets' files
        except pa.ArrowInvalid:
            source = pa.memory_map(str(path))
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"data.path: cannot read {str(path)!r} as Arrow: {e}") from None
    yield from _table_rows(batches, reader.schema.names, columns, path)


def _dataset_dir(path: Path, columns: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """A ``datasets.save_to_disk`` directory: its ``state.json`` lists the Arrow files; of a
    ``DatasetDict``, the ``train`` split."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ConfigError(f"data.path: {str(path)!r} is a DatasetDict without a 'train' "
                              f"split (splits: {', '.join(splits)}); name the split's "
                              "directory")
        path = path / "train"
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"data.path: {str(path)!r}: not a datasets.save_to_disk directory "
                          f"(state.json: {e})") from None
    for f in files:
        yield from _arrow(f, columns)


def object_rows(source: Any, columns: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """The rows of a Python source: a ``datasets.Dataset``, a grain data source, or any
    sequence of mappings (``len`` and integer indexing)."""
    name = type(source).__name__
    try:
        n = len(source)
    except TypeError:
        raise ConfigError(f"data source: a {name} has no len(); expected a datasets.Dataset, "
                          "a grain data source or a list of records") from None
    for i in range(n):
        where = f"{name} row {i}"
        yield where, _pick(source[i], columns, where)
