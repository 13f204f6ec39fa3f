"""Whether the files of a text source are text: a record, compressed or binary file read as
text would train a model on its bytes.

A text source (``data.path`` that is not records, ``zjax tokenize`` of text files) is refused,
naming the file and the record formats zjax reads, when one of its files

- starts as a compressed or binary container does (gzip, zstd, bzip2, xz, zip, 7z, lz4,
  Parquet, Arrow, a ``.npy``, a pickle), or holds a NUL byte in its first 64 KiB;
- or, named on its own (a file or a glob, not found in a directory), has the extension of a
  compressed file or of a table or JSON (``.json``, ``.csv``, ``.tsv``, ``.gz``, ``.bz2``,
  ``.xz``, ``.zst``, ``.zip``, ``.parquet.gz``, ... in any case): zjax reads records only as
  ``.jsonl`` (plain, ``.gz``, ``.zst``), ``.parquet`` and ``.arrow``.

Inside a directory of text (a code corpus) a ``.json`` or ``.csv`` file is text like the
others; a binary one is still refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from zjax.errors import ConfigError

__all__ = ["RECORD_EXTENSIONS", "check_text_files"]

RECORD_EXTENSIONS = ".jsonl, .jsonl.gz, .jsonl.zst, .ndjson, .parquet, .arrow"
_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2",
          b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip", b"7z\xbc\xaf\x27\x1c": "7z",
          b"\x04\x22\x4d\x18": "lz4", b"PAR1": "Parquet", b"ARROW1": "Arrow",
          b"\xff\xff\xff\xff": "Arrow stream", b"\x93NUMPY": ".npy", b"\x80\x04\x95": "pickle",
          b"\x80\x05\x95": "pickle"}
_NOT_TEXT = (".json", ".csv", ".tsv", ".gz", ".bz2", ".xz", ".zst", ".zstd", ".zip", ".7z",
             ".lz4", ".tar", ".tgz", ".npy", ".npz", ".pkl", ".pickle", ".feather", ".orc",
             ".avro", ".xlsx", ".xls", ".h5", ".hdf5", ".safetensors", ".pt", ".bin")
_HEAD = 1 << 16


def _container(path: Path) -> str | None:
    """What binary format ``path`` starts as (None: it may be text)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return None  # the reader names the file when it cannot read it
    for magic, name in _MAGIC.items():
        if head.startswith(magic) and (name != "bzip2" or head[4:10] == b"1AY&SY"):
            return f"a {name} file"
    if b"\x00" in head:
        return "binary (it holds NUL bytes)"
    return None


def check_text_files(item: str | None, files: Sequence[Path], *, key: str) -> None:
    """Refuse a file of ``files`` (the text files of the source ``item``) that is not text.

    Raises:
      ConfigError: naming the file, what it is, and the formats zjax reads.
    """
    named = item is None or not Path(item).is_dir()
    for f in files:
        what, hint = _container(f), "convert it to one of those"
        suffix = next((s for s in _NOT_TEXT if f.name.lower().endswith(s)), None)
        if what is None and named and suffix is not None:
            what = f"a {suffix} file (not a format zjax reads records from)"
            hint += "; a file that is plain text: name it .txt"
        if what == "a .npy file" or (what is not None and suffix == ".npy"):
            hint = "a .npy of token ids is trained on as it is: data.path: FILE.npy"
        if what is not None:
            raise ConfigError(f"{key}: {str(f)!r} is {what}, not text: its bytes would become "
                              f"the tokens; records are read from {RECORD_EXTENSIONS} "
                              f"({hint})")
