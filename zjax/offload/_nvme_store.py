"""Swap files under ``nvme_path``: named flat float32 arrays read and written by element range,
asynchronously, for the NVMe tier (ZeRO-Infinity) of the optimizer state.

Each array is one preallocated file (``NAME.swp``) in the store's own locked directory under
``nvme_path`` (:mod:`zjax.offload._swap_dir`: runs sharing a path never share a file, and a dead
run's directory is removed by the next store opened there). Reads fill fresh buffers with
``os.preadv`` and writes use ``os.pwrite`` from a thread pool (the file descriptors are shared:
positional I/O needs no lock). Swap files are a working area, not checkpoints: a kill may tear
them.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from zjax.errors import ConfigError, NvmeError
from zjax.offload._swap_dir import SwapDir, remove_stale, swap_dirs

__all__ = ["NvmeStore", "check_nvme_path"]

_ITEM = 4  # float32


def check_nvme_path(path: str | os.PathLike, nbytes: int, *, key: str) -> Path:
    """``path`` as a directory that exists, is writable and has ``nbytes`` free.

    Raises:
      ConfigError: naming ``key``, the path and the bytes needed.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key}: {str(p)!r} does not exist; create the directory (the swap "
                          f"files need {nbytes / 2**30:.2f} GiB)")
    if not p.is_dir():
        raise ConfigError(f"{key}: {str(p)!r} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {str(p)!r} is not writable")
    free = shutil.disk_usage(p).free
    if free < nbytes:
        others = [s for s in swap_dirs(p) if s.live]
        held = "".join(f"; another run's swap files hold space there ({s.describe()})"
                       for s in others[:3])
        raise ConfigError(f"{key}: {str(p)!r} has {free / 2**30:.2f} GiB free, but the swap "
                          f"files need {nbytes / 2**30:.2f} GiB{held}")
    return p


class NvmeStore:
    """Flat float32 arrays in files under ``path``, one file each, by name.

    Args:
      path: ``nvme_path`` (checked by :func:`check_nvme_path` once the swap directories of
        dead runs there are removed); the files go in a directory of this store's own.
      sizes: elements of each array, by name (a name is a file name: no ``/``).
      threads: I/O threads (reads and writes in flight at once).
      key: the config key that named ``path`` (for errors).
    """

    def __init__(self, path: str | os.PathLike, sizes: Mapping[str, int], *, threads: int = 4,
                 key: str = "nvme_path"):
        self.sizes = dict(sizes)
        self.nbytes = sum(self.sizes.values()) * _ITEM
        self.key = key
        self._fds: dict[str, int] = {}
        self._dir: SwapDir | None = None
        root = check_nvme_path(path, 0, key=key)
        remove_stale(root, key=key)
        self.root = check_nvme_path(root, self.nbytes, key=key)
        try:
            self._dir = SwapDir(self.root)
            self.path = self._dir.path
            for name, size in self.sizes.items():
                if "/" in name or not name:
                    raise ValueError(f"swap file name {name!r}")
                fd = os.open(self.file(name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds[name] = fd
                if size:  # reserve the space now: a full disk fails here, not mid-run
                    os.posix_fallocate(fd, 0, size * _ITEM)
        except OSError as e:
            self.close()
            raise ConfigError(f"{key}: cannot create swap files in {str(self.root)!r}: {e}; "
                              f"they need {self.nbytes / 2**30:.2f} GiB") from None
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "zjax-nvme")
        self.read_bytes = self.written_bytes = 0

    def file(self, name: str) -> Path:
        return self.path / f"{name}.swp"

    def _range(self, name: str, start: int, count: int) -> int:
        if start < 0 or count < 0 or start + count > self.sizes[name]:
            raise IndexError(f"{name}[{start}:{start + count}] outside its "
                             f"{self.sizes[name]} elements")
        return start * _ITEM

    def read_now(self, name: str, start: int, count: int,
                 out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``start .. start + count`` of ``name``, read synchronously (into ``out``,
        a float32 buffer of ``count`` elements, if given)."""
        offset = self._range(name, start, count)
        out = np.empty(count, np.float32) if out is None else out
        view, done = memoryview(out).cast("B"), 0
        while done < out.nbytes:
            try:
                n = os.preadv(self._fds[name], [view[done:]], offset + done)
            except OSError as e:
                raise NvmeError(f"{self.key}: reading {self.file(name)} failed ({e})") from e
            if n == 0:
                raise NvmeError(f"{self.key}: {self.file(name)}: unexpected end of file at "
                                f"byte {offset + done} (was it removed or cut while in use?)")
            done += n
        self.read_bytes += out.nbytes
        return out

    def write_now(self, name: str, start: int, values: np.ndarray) -> None:
        """Write ``values`` (float32) at element ``start`` of ``name``, synchronously."""
        values = np.ascontiguousarray(values, np.float32)
        offset = self._range(name, start, values.size)
        view, done = memoryview(values).cast("B"), 0
        while done < values.nbytes:
            try:
                done += os.pwrite(self._fds[name], view[done:], offset + done)
            except OSError as e:  # ENOSPC: a disk that filled under another writer
                raise NvmeError(f"{self.key}: writing {self.file(name)} failed ({e}); the "
                                f"swap files need {self.nbytes / 2**30:.2f} GiB") from e
        self.written_bytes += values.nbytes

    def read(self, name: str, start: int, count: int) -> concurrent.futures.Future:
        # the buffer is allocated here, not in the I/O thread: each thread allocating would
        # grow (and keep) a malloc arena of its own
        out = np.empty(count, np.float32)
        return self._pool.submit(self.read_now, name, start, count, out)

    def write(self, name: str, start: int, values: np.ndarray) -> concurrent.futures.Future:
        return self._pool.submit(self.write_now, name, start, values)

    def close(self, *, remove: bool = True) -> None:
        """Wait for the I/O in flight, close the files and (``remove``) delete them with their
        directory; the directory's lock is released either way (a kept one is a dead run's
        to the next store opened under the same path)."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._dir is not None:
            self._dir.close(remove=remove)
            self._dir = None

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
