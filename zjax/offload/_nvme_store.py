"""Swap files under ``nvme_path``: named flat float32 arrays read and written by element range,
asynchronously, for the NVMe tier (ZeRO-Infinity) of the optimizer state and parameters.

Each array is one preallocated file (``NAME.swp``) in the store's own locked directory under
``nvme_path`` (:mod:`zjax.offload._swap_dir`: runs sharing a path never share a file, and a dead
run's directory is removed by the next store opened there). Reads fill page-aligned buffers
(fresh, or given back by :meth:`NvmeStore.recycle`) with ``os.preadv`` and writes use
``os.pwrite`` from a thread pool (the file descriptors are shared:
positional I/O needs no lock). Swap files are a working area, not checkpoints: a kill may tear
them.

The whole pages of a range move with ``O_DIRECT`` (as DeepSpeed's aio does): no copy through
the page cache and no writeback after it, which on a machine of few cores costs as much CPU
as the training itself. Read buffers are allocated at the file offset's page alignment, a
write's values copied to such a buffer when they are not; the partial pages at a range's ends
go through the page cache (the kernel keeps the two coherent: a direct write writes back and
drops the cached pages it covers). A filesystem without ``O_DIRECT`` (tmpfs) gets buffered I/O.
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from zjax.errors import ConfigError, NvmeError
from zjax.offload._swap_dir import SwapDir, remove_stale, swap_dirs

__all__ = ["NvmeStore", "check_nvme_path"]

_ITEM = 4  # float32
# O_DIRECT's alignment of offsets, lengths and memory (any block size up to it), and the unit
# the partial pieces go through the page cache in: the kernel's page, so that no cached page is
# ever written beside a direct transfer (64 KiB on some aarch64 kernels)
_PAGE = max(4096, mmap.PAGESIZE)
_BOUNCE = 1 << 16  # a write smaller than this is not worth copying to an aligned buffer


def _aligned(nbytes: int, offset: int) -> np.ndarray:
    """An uninitialised byte buffer whose address is ``offset`` modulo the page size: the
    whole pages of a range at file ``offset`` can move by ``O_DIRECT`` straight into it."""
    raw = np.empty(nbytes + _PAGE, np.uint8)
    shift = (offset - raw.ctypes.data) % _PAGE
    return raw[shift:shift + nbytes]


def _open_direct(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT)
    except (OSError, AttributeError):  # EINVAL: no O_DIRECT on this filesystem
        return None


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
      keep_bytes: at most this many bytes of buffers kept for reuse (:meth:`recycle`).
    """

    def __init__(self, path: str | os.PathLike, sizes: Mapping[str, int], *, threads: int = 4,
                 key: str = "nvme_path", keep_bytes: int = 1 << 30):
        self.sizes = dict(sizes)
        self.nbytes = sum(self.sizes.values()) * _ITEM
        self.key = key
        self._fds: dict[str, int] = {}
        self._direct: dict[str, int] = {}
        self._all_direct: list[int] = []
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
                if (direct := _open_direct(self.file(name))) is not None:
                    self._direct[name] = direct
                    self._all_direct.append(direct)
        except OSError as e:
            self.close()
            raise ConfigError(f"{key}: cannot create swap files in {str(self.root)!r}: {e}; "
                              f"they need {self.nbytes / 2**30:.2f} GiB") from None
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "zjax-nvme")
        self.read_bytes = self.written_bytes = 0
        self.direct_bytes = 0  # of those, moved by O_DIRECT (the rest through the page cache)
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int], list[np.ndarray]] = {}
        self._kept, self.keep_bytes = 0, keep_bytes

    def file(self, name: str) -> Path:
        return self.path / f"{name}.swp"

    def _range(self, name: str, start: int, count: int) -> int:
        if start < 0 or count < 0 or start + count > self.sizes[name]:
            raise IndexError(f"{name}[{start}:{start + count}] outside its "
                             f"{self.sizes[name]} elements")
        return start * _ITEM

    def _piece(self, name: str, pos: int, address: int, left: int) -> tuple[int, int]:
        """``(fd, bytes)`` of the next piece of a transfer at file byte ``pos`` and memory
        ``address`` with ``left`` bytes to go: whole pages by ``O_DIRECT`` where both are
        page-aligned, else through the page cache up to the next page boundary."""
        direct = self._direct.get(name)
        if direct is None or address % _PAGE != pos % _PAGE:
            return self._fds[name], left
        if pos % _PAGE == 0 and left >= _PAGE:
            return direct, left - left % _PAGE
        return self._fds[name], min(left, _PAGE - pos % _PAGE)

    def _transfer(self, name: str, offset: int, buf: np.ndarray, *, write: bool) -> None:
        view, done, base = memoryview(buf).cast("B"), 0, buf.ctypes.data
        while done < buf.nbytes:
            fd, n = self._piece(name, offset + done, base + done, buf.nbytes - done)
            try:
                k = (os.pwrite(fd, view[done:done + n], offset + done) if write
                     else os.preadv(fd, [view[done:done + n]], offset + done))
            except OSError as e:
                if fd != self._fds[name] and e.errno == errno.EINVAL:
                    # O_DIRECT refused after all: buffered from now on (the descriptor
                    # closed with the rest: another thread may be using it)
                    self._direct.pop(name, None)
                    continue
                raise
            if k == 0 and not write:
                raise NvmeError(f"{self.key}: {self.file(name)}: unexpected end of file at "
                                f"byte {offset + done} (was it removed or cut while in use?)")
            done += k
            if fd != self._fds[name]:
                with self._lock:
                    self.direct_bytes += k

    def read_now(self, name: str, start: int, count: int,
                 out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``start .. start + count`` of ``name``, read synchronously (into ``out``,
        a float32 buffer of ``count`` elements, if given)."""
        offset = self._range(name, start, count)
        if out is None:
            out = self._take(count * _ITEM, offset).view(np.float32)
        try:
            self._transfer(name, offset, out, write=False)
        except OSError as e:
            raise NvmeError(f"{self.key}: reading {self.file(name)} failed ({e})") from e
        with self._lock:
            self.read_bytes += out.nbytes
        return out

    def write_now(self, name: str, start: int, values: np.ndarray) -> None:
        """Write ``values`` (float32) at element ``start`` of ``name``, synchronously."""
        values = np.ascontiguousarray(values, np.float32).reshape(-1)
        offset, bounce = self._range(name, start, values.size), None
        if (name in self._direct and values.nbytes >= _BOUNCE
                and values.ctypes.data % _PAGE != offset % _PAGE):
            bounce = self._take(values.nbytes, offset)
            bounce[:] = values.view(np.uint8)
            values = bounce.view(np.float32)
        try:
            self._transfer(name, offset, values, write=True)
        except OSError as e:  # ENOSPC: a disk that filled under another writer
            raise NvmeError(f"{self.key}: writing {self.file(name)} failed ({e}); the "
                            f"swap files need {self.nbytes / 2**30:.2f} GiB") from e
        finally:
            if bounce is not None:
                self.recycle(bounce)
        with self._lock:
            self.written_bytes += values.nbytes

    def _take(self, nbytes: int, offset: int) -> np.ndarray:
        """A byte buffer for a transfer at file ``offset``: a recycled one of that size and
        alignment, or a fresh one."""
        with self._lock:
            kept = self._free.get((nbytes, offset % _PAGE))
            if kept:
                self._kept -= nbytes
                return kept.pop()
        return _aligned(nbytes, offset)

    def recycle(self, *buffers: np.ndarray) -> None:
        """Give back buffers this store's reads returned, once nothing holds them: not after
        ``jax.device_put`` (XLA:CPU takes page-aligned host memory as the device array's
        own), only once a computation that read them has finished. Later reads of the same
        size reuse them instead of faulting in fresh pages, up to :attr:`keep_bytes` kept."""
        with self._lock:
            for b in buffers:
                if self._kept + b.nbytes > self.keep_bytes:
                    continue
                b = b.reshape(-1).view(np.uint8)
                self._free.setdefault((b.nbytes, b.ctypes.data % _PAGE), []).append(b)
                self._kept += b.nbytes

    def read(self, name: str, start: int, count: int) -> concurrent.futures.Future:
        # the buffer is allocated here, not in the I/O thread: each thread allocating would
        # grow (and keep) a malloc arena of its own
        out = self._take(count * _ITEM, self._range(name, start, count)).view(np.float32)
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
        for fd in {*self._fds.values(), *self._direct.values(), *self._all_direct}:
            os.close(fd)
        self._fds, self._direct, self._all_direct = {}, {}, []
        if self._dir is not None:
            self._dir.close(remove=remove)
            self._dir = None

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
