"""JAX's persistent compilation cache as the suite uses it: entries written whole.

JAX's file cache (``jax._src.lru_cache.LRUCache``, jax 0.10) writes an entry with
``Path.write_bytes`` in place and takes no lock unless it evicts
(``jax_compilation_cache_max_size``, whose eviction reads every entry's access-time file on
each write): a worker reading the entry another worker is writing gets a torn one, which JAX
turns into a warning ("Error reading persistent compilation cache entry") and a recompile.
:func:`atomic_writes` makes each write a temporary file in the same folder renamed into place,
so a reader sees the whole entry or none. Subprocesses (``helpers.cli_env``) write with JAX's
own ``put``; a torn read of theirs costs a recompile and a warning, never a wrong program.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["atomic_writes"]


def atomic_writes() -> None:
    """Patch this process's JAX cache to write entries whole (temp file, then rename)."""
    try:
        from jax._src import lru_cache
        put, suffix = lru_cache.LRUCache.put, lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):  # another JAX: its cache as it is
        warnings.warn("tests/compile_cache.py: JAX's LRUCache moved; entries are written as "
                      "JAX writes them", stacklevel=2)
        return

    def whole(self, key: str, value: bytes) -> None:
        if self.eviction_enabled or not key:  # JAX's own path: locked (or its error)
            return put(self, key, value)
        path = self.path / f"{key}{suffix}"
        if path.exists():
            return None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(value)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return None

    whole.__doc__ = put.__doc__
    lru_cache.LRUCache.put = whole
