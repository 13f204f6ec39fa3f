"""Safetensors, read memory-mapped and written streamed, one tensor at a time.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header size, a
JSON header ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then
the raw little-endian bytes. Reading maps the file, so a slice of a tensor reads only its pages;
bfloat16 (which the ``safetensors`` package's numpy API cannot return) is ``ml_dtypes``'.
A model larger than one file is a set of files and ``model.safetensors.index.json``
(``{"weight_map": {name: file}}``); where a directory holds both, ``model.safetensors`` is read,
as transformers does.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from zjax.errors import CheckpointError

__all__ = ["DTYPES", "SafetensorsDir", "read_header", "write_safetensors"]

DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the format's own bound
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
log = logging.getLogger("zjax")


def read_header(path: Path) -> tuple[dict, dict, int]:
    """``(tensors, metadata, data start)`` of one safetensors file, checked against its size:
    every tensor has a known dtype, a shape of sizes >= 0 and offsets within the file that
    hold exactly ``prod(shape) x itemsize`` bytes.

    Raises:
      CheckpointError: not a safetensors file, or a tensor entry that is not one (naming the
        file and the tensor).
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (its header size reads "
                                      f"{n}, the file has {size} bytes)")
            raw = f.read(n)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: "
                              f"{e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is a JSON "
                              f"{type(header).__name__}, not an object of tensors)")
    metadata = header.pop("__metadata__", None)
    start = 8 + n
    for name, t in header.items():
        _check_entry(path, name, t, size - start)
    return header, metadata if isinstance(metadata, dict) else {}, start


def _check_entry(path: Path, name: str, t, data_bytes: int) -> None:
    """Refuse a header entry that does not describe a tensor within the data."""
    def bad(what: str):
        return CheckpointError(f"{path}: tensor {name!r} {what}")

    if not isinstance(t, dict):
        raise bad(f"is {t!r}, not an entry with dtype, shape and data_offsets")
    if t.get("dtype") not in DTYPES:
        raise bad(f"has dtype {t.get('dtype')!r}; expected one of {', '.join(DTYPES)}")
    shape, offsets = t.get("shape"), t.get("data_offsets")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"has shape {shape!r}; expected a list of sizes >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets))
            or offsets[0] > offsets[1]):
        raise bad(f"has data_offsets {offsets!r}; expected [begin, end] with "
                  "0 <= begin <= end")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[t["dtype"]].itemsize
    if end - begin != want:
        raise bad(f"({t['dtype']} {shape}: {want} bytes) has data_offsets {begin}..{end}: "
                  f"{end - begin} bytes (damaged)")
    if end > data_bytes:
        raise bad(f"({t['dtype']} {shape}) does not fit its offsets {begin}..{end}: the file "
                  f"holds {data_bytes} bytes of data (truncated or damaged)")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsDir:
    """The tensors of ``model.safetensors`` or of a sharded set in one directory.

    Args:
      directory: holds ``model.safetensors.index.json`` and the files it names, or a single
        ``*.safetensors`` file.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for path in self._files():
            header, _, start = read_header(path)
            for name, t in header.items():
                self._where[name] = (path, t, start)

    def _files(self) -> list[Path]:
        # transformers' order (from_pretrained, PyTorch and Flax): model.safetensors first,
        # then the index; a directory holding both is read as transformers reads it
        index, single = self.directory / INDEX, self.directory / SINGLE
        if single.is_file():
            if index.is_file():
                log.warning("%s holds both %s and %s: reading %s, as transformers does (the "
                            "index and the files it names are ignored)", self.directory,
                            SINGLE, INDEX, SINGLE)
            return [single]
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError,
                    TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (expected JSON with "
                                      f"a 'weight_map'): {e}") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and f and "/" not in f for f in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map is not an object of tensor name "
                                      "-> file name in this directory")
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [str(f.name) for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names files that are not there: "
                                      f"{', '.join(missing)}")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if len(files) != 1:
            raise CheckpointError(
                f"{self.directory}: expected one *.safetensors file or {INDEX}, found "
                f"{len(files)} safetensors file{'s' if len(files) != 1 else ''}")
        return files

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1]["shape"])

    def array(self, name: str) -> np.ndarray:
        """The tensor ``name``, memory-mapped read-only (slicing it reads only those bytes)."""
        path, t, start = self._entry(name)
        dtype = DTYPES[t["dtype"]]
        begin, end = t["data_offsets"]
        if end == begin:
            return np.zeros(t["shape"], dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=start + begin,
                         shape=tuple(t["shape"]))

    def _entry(self, name: str):
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: no tensor {name!r} in its safetensors")
        return self._where[name]


def write_safetensors(path: Path, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
                      produce: Callable[[], Iterable[np.ndarray]], *,
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name, shape, dtype; in file order) to ``path``, atomically.

    ``produce()`` yields their values in the same order, so only one need be in memory; the
    file appears whole (renamed from ``PATH.partial``) or not at all.
    """
    tensors = list(tensors)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _CODES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            values = iter(produce())
            for name, shape, dtype in tensors:
                value = np.ascontiguousarray(next(values), dtype=dtype)
                if value.shape != tuple(shape):
                    raise ValueError(f"{name}: produced {value.shape}, declared {shape}")
                f.write(value.reshape(-1).view(np.uint8).data)
                del value
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
