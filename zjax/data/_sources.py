"""Record sources: which files a ``data.path`` names, and their rows, one at a time.

A source is a file, a directory or a glob (or a list of them). By extension a file holds
records (JSON lines, optionally gzip or zstd compressed; Parquet; Arrow IPC, as
``datasets.save_to_disk`` writes), a ``zjax tokenize`` store (a directory), or text. Rows are
read streaming (Parquet and Arrow by record batch, memory-mapped; JSON lines by line), so a
source larger than memory is read in one pass. Each row comes with where it is
(``FILE, row N``), for the errors.

A damaged source is an error naming the file, never a shorter dataset: a compressed file that
ends inside a gzip member or a zstd frame (zstandard's own stream reader returns what decoded
as if the file ended there), an Arrow stream without its end-of-stream marker (the stream
reader stops at the last whole batch), a Parquet page that does not decode (or whose checksum
does not match), an Arrow batch whose buffers do not validate. A file cut exactly between two
gzip members or zstd frames is a valid file, and cannot be told from one.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from zjax.errors import ConfigError

__all__ = ["STORE_META", "is_partial", "is_record_file", "object_rows", "record_files", "rows",
           "source_kind"]

STORE_META = "zjax-tokens.json"  # marks a zjax tokenize directory
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
_RECORDS = (*_JSONL, ".parquet", ".arrow")
_BATCH = 1024  # Parquet and Arrow rows decoded at a time
# the hidden outputs an unfinished `zjax tokenize` / `import-hf` builds in (_store.partial_path)
_PARTIAL = re.compile(r"\..+\.partial-\d+-.+")


def is_partial(path: Path) -> bool:
    """Whether ``path`` is in a partial output (``_store.partial_path``'s names), which no
    source may read."""
    return any(_PARTIAL.fullmatch(part) for part in path.parts)


def is_record_file(path: Path) -> bool:
    return path.name.lower().endswith(_RECORDS)


def _is_hf_dir(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _expand(item: str, key: str) -> list[Path]:
    p = Path(item)
    if p.is_dir():
        if (p / STORE_META).is_file() or _is_hf_dir(p):
            return [p]
        # hidden files, and what an interrupted `zjax tokenize` left, are never records
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")
                       and not is_partial(f.relative_to(p)))
        if not files:
            raise ConfigError(f"{key}: directory {item!r} holds no file")
        return files
    if p.is_file():
        return [p]
    found = sorted(Path(f) for f in glob.glob(os.fspath(item), recursive=True)
                   if not is_partial(Path(f)))
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


def rows(files: Sequence[Path], columns: Sequence[str], *, optional: Sequence[str] = ()
         ) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row of ``files`` in order; ``row`` holds ``columns``, and
    those of the ``optional`` columns that its file has (a JSON line's own fields; Parquet's
    and Arrow's columns, null in a row that has no value); ``optional`` ``("*",)``: every
    column.

    Raises:
      ConfigError: a file that cannot be read, a row that is not a JSON object, a missing
        column; each names the file (and row).
    """
    for f in files:
        if f.is_dir():
            yield from _dataset_dir(f, columns, optional)
        elif f.name.lower().endswith(_JSONL):
            yield from _jsonl(f, columns, optional)
        elif f.name.lower().endswith(".parquet"):
            yield from _parquet(f, columns, optional)
        else:
            yield from _arrow(f, columns, optional)


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame.

    Raises ``EOFError`` where the file ends inside a frame (zstandard's ``stream_reader``
    returns the bytes that decoded and then end-of-file, as if the data ended there) and
    ``OSError`` on bytes that are not zstd."""

    def __init__(self, raw):
        import zstandard

        self._raw, self._error, self._new = raw, zstandard.ZstdError, \
            zstandard.ZstdDecompressor().decompressobj
        self._frame, self._inside = self._new(), False
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._at == len(self._out):
            chunk = self._raw.read(1 << 16)
            if not chunk:
                if self._inside:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self._out, self._at = self._decode(chunk), 0
        n = min(len(b), len(self._out) - self._at)
        b[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def _decode(self, data: bytes) -> bytes:
        out = []
        while data:
            try:
                out.append(self._frame.decompress(data))
            except self._error as e:
                raise OSError(f"not zstd data ({e})") from None
            self._inside = not self._frame.eof
            data = b""
            if self._frame.eof:  # the next frame starts in what is left
                data, self._frame = self._frame.unused_data, self._new()
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _opened(path: Path) -> io.TextIOBase:
    name = path.name.lower()
    raw = open(path, "rb")  # noqa: SIM115 - closed by the wrapper
    if name.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    elif name.endswith(".zst"):
        raw = io.BufferedReader(_ZstdFrames(raw))
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict")


# a lone surrogate can only come from a JSON escape (the line itself is valid UTF-8)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _jsonl(path: Path, columns: Sequence[str], optional: Sequence[str] = ()
           ) -> Iterator[tuple[str, dict]]:
    n = 0
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
                except RecursionError:
                    raise ConfigError(f"{where}: JSON nested too deeply to read") from None
                row = _pick(row, columns, where)
                if _SURROGATE_ESCAPE.search(line):
                    check_text(row, _present(row, columns, optional), where)
                yield where, row
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        damage = "" if getattr(e, "errno", None) else "; the file is damaged or truncated"
        raise ConfigError(f"data.path: cannot read {str(path)!r} (after row {n}): "
                          f"{_why(e)}{damage}") from None


def check_text(row: dict, columns: Sequence[str], where: str) -> None:
    """Refuse a string in ``row[columns]`` (at any depth) that is not valid Unicode text: a
    lone surrogate (``"\\ud800"`` in JSON) has no UTF-8 encoding, so no tokenizer reads it."""

    def walk(value, at: str) -> None:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"{where}: {at} holds a lone surrogate "
                                  f"({value[e.start]!r} at character {e.start}), which is not "
                                  "text (no UTF-8 encoding); fix or drop the row") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{at}[{k!r}]")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{at}[{i}]")

    for c in columns:
        walk(row[c], f"field {c!r}")


def _pick(row: Any, columns: Sequence[str], where: str) -> dict:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with {_names(columns)}, got "
                          f"{type(row).__name__}")
    for c in columns:
        if c in row and row[c] is None:
            raise ConfigError(f"{where}: field {c!r} is null, expected a value")
        if c not in row:
            have = ", ".join(map(repr, sorted(row))) or "none"
            raise ConfigError(f"{where}: no field {c!r} (fields: {have})")
    return row


def _present(row: dict, columns: Sequence[str], optional: Sequence[str]) -> list[str]:
    """``columns`` and those of ``optional`` that ``row`` has."""
    return [*columns, *(c for c in optional if c in row and c not in columns)]


def _wanted(columns: Sequence[str], optional: Sequence[str], names: Sequence[str]) -> list:
    """The columns of ``names`` to read: ``columns`` and ``optional`` (``"*"``: all)."""
    extra = names if "*" in optional else optional
    return [c for c in dict.fromkeys([*columns, *extra]) if c in names]


def _names(columns: Sequence[str]) -> str:
    return " and ".join(repr(c) for c in columns)


def _table_rows(batches, schema_names, columns, path: Path, *, validate: bool = False,
                optional: Sequence[str] = ()) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa

    missing = [c for c in columns if c not in schema_names]
    if missing:
        raise ConfigError(f"{path}: no column {missing[0]!r} (columns: "
                          f"{', '.join(map(repr, schema_names))})")
    n = 0
    batches = iter(batches)
    while True:
        try:  # a page or batch that does not decode is damage, not the end of the data
            batch = next(batches, None)
            if batch is not None and validate:  # memory-mapped buffers, never checked
                batch.validate(full=True)
            wanted = _wanted(columns, optional, schema_names)
            picked = None if batch is None else batch.select(wanted).to_pylist()
        except (OSError, pa.ArrowException, UnicodeDecodeError, EOFError) as e:
            raise ConfigError(f"data.path: cannot read {str(path)!r} (after row {n}): "
                              f"{_why(e)}; the file is damaged or truncated") from None
        if picked is None:
            return
        for row in picked:
            n += 1
            yield f"{path}, row {n}", _pick(row, columns, f"{path}, row {n}")


def _parquet(path: Path, columns: Sequence[str], optional: Sequence[str] = ()
             ) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, memory_map=True, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"data.path: cannot read {str(path)!r} as Parquet: "
                          f"{_why(e)}") from None
    names = pf.schema_arrow.names
    have = _wanted(columns, optional, names)
    yield from _table_rows(pf.iter_batches(batch_size=_BATCH, columns=have or None),
                           names, columns, path, optional=optional)


def _magic(path: Path) -> bool:
    """Whether ``path`` starts as an Arrow file (not a stream) does."""
    try:
        with open(path, "rb") as f:
            return f.read(6) == b"ARROW1"
    except OSError:
        return False


def _why(e: BaseException) -> str:
    """``e``'s first line, without its full stop (the library's words, in ours)."""
    return (str(e).splitlines()[0].rstrip(". ") if str(e).strip() else type(e).__name__)


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow stream's end-of-stream marker


def _arrow(path: Path, columns: Sequence[str], optional: Sequence[str] = ()
           ) -> Iterator[tuple[str, dict]]:
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
            if source.size() < len(_EOS) or source.read_at(len(_EOS), source.size()
                                                           - len(_EOS)) != _EOS:
                raise ConfigError(f"data.path: {str(path)!r}: the Arrow stream does not end "
                                  "with its end-of-stream marker: the file is truncated (or "
                                  "its writer was never closed)")
    except (OSError, pa.ArrowException) as e:
        why = " (an Arrow file without its footer: truncated?)" if _magic(path) else ""
        raise ConfigError(f"data.path: cannot read {str(path)!r} as Arrow{why}: "
                          f"{_why(e)}") from None
    yield from _table_rows(batches, reader.schema.names, columns, path, validate=True,
                           optional=optional)


def _dataset_dir(path: Path, columns: Sequence[str], optional: Sequence[str] = ()
                 ) -> Iterator[tuple[str, dict]]:
    """A ``datasets.save_to_disk`` directory: its ``state.json`` lists the Arrow files; of a
    ``DatasetDict``, the ``train`` split."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            splits = [str(s) for s in splits]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"data.path: {str(path)!r}: dataset_dict.json is not a "
                              f"datasets DatasetDict's ({type(e).__name__}: {e})") from None
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
        yield from _arrow(f, columns, optional)


def object_rows(source: Any, columns: Sequence[str], *, optional: Sequence[str] = ()
                ) -> Iterator[tuple[str, dict]]:
    """The rows of a Python source: a ``datasets.Dataset``, a grain data source, or any
    sequence of mappings (``len`` and integer indexing); ``optional`` as for :func:`rows`."""
    name = type(source).__name__
    try:
        n = len(source)
    except TypeError:
        raise ConfigError(f"data source: a {name} has no len(); expected a datasets.Dataset, "
                          "a grain data source or a list of records") from None
    for i in range(n):
        where = f"{name} row {i}"
        row = _pick(source[i], columns, where)
        check_text(row, _present(row, columns, optional), where)
        yield where, row
