"""Compiles for compile-only targets, kept on disk beside JAX's compilation cache.

JAX's persistent cache cannot give back an executable compiled for a compile-only target:
reading one needs a client of that accelerator (``PjRtCompiler must be constructed with a
Client``), so every ``zjax plan --target`` compiled again (a minute or more for a large step
on libtpu). What a plan reads of such a compile is its memory figures and its scheduled HLO;
those are kept here, under ``<jax_compilation_cache_dir>/zjax-targets/``, and only when JAX's
persistent cache is on (the same opt-in: ``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``).

An entry is keyed by all that decides the compile: the lowered program (StableHLO with its
shardings, without debug locations), the jit's compiler options, the devices (id, kind,
coordinates, process), the compiler (jax, jaxlib, the plugin packages' versions and the
client's platform version) and the compiler flags of this process's environment
(``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``), sorted as JAX's own cache key sorts them: their order
decides nothing, and the CLI moves the simulated device count to the end of ``XLA_FLAGS``, so
unsorted the same compile missed depending on what ran before it in the process. This module
reads the process environment for those flags.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
import zlib
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from zjax.runtime._plugins import held_stderr

__all__ = ["CompiledFigures", "compile_for_target"]

_STATS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes",
          "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
          "host_temp_size_in_bytes", "host_generated_code_size_in_bytes")
_PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt",
             "jax-cuda13-plugin", "jax-cuda13-pjrt")
_ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_VERSION = 1  # of the entry's layout


class MemoryStats:
    """``memory_analysis()`` of a kept compile: the same ``*_size_in_bytes`` attributes."""

    def __init__(self, stats: dict[str, int]):
        self.__dict__.update(stats)

    def __repr__(self) -> str:
        return f"MemoryStats({self.__dict__})"


class CompiledFigures:
    """What a plan reads of a compiled step: ``memory_analysis()`` and ``as_text()``.

    Returned for compile-only targets (nothing can run on them), whether compiled now or read
    from the cache; ``cached`` says which.
    """

    def __init__(self, stats: dict[str, int], text: str, *, cached: bool):
        self._stats, self._text, self.cached = stats, text, cached

    def memory_analysis(self) -> MemoryStats:
        return MemoryStats(self._stats)

    def as_text(self) -> str:
        return self._text


def _cache_dir(given: str | os.PathLike | None) -> Path | None:
    if given is not None:
        return Path(given)
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / "zjax-targets" if root else None


def _versions(devices: list) -> list[str]:
    found = []
    for name in _PACKAGES:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return [*found, devices[0].client.platform_version]


def _options(lowered: jax.stages.Lowered) -> tuple | None:
    """The jit's ``compiler_options`` (they are not in the program's text); None where this
    jax keeps them elsewhere (then nothing is cached)."""
    options = getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", None)
    return tuple(sorted((str(k), str(v)) for k, v in options)) if options is not None else None


def _key(lowered: jax.stages.Lowered, devices: list, options: tuple) -> str:
    h = hashlib.sha256()
    parts = [f"v{_VERSION}", *_versions(devices), repr(options),
             *(f"{v}={' '.join(sorted(os.environ.get(v, '').split()))}" for v in _ENV_FLAGS),
             *(f"{d.id}:{d.device_kind}:{getattr(d, 'coords', None)}:{d.process_index}"
               for d in devices)]
    for part in parts:
        h.update(part.encode() + b"\0")
    h.update(lowered.as_text(debug_info=False).encode())
    return h.hexdigest()


def _read(path: Path) -> CompiledFigures | None:
    try:
        entry = json.loads(gzip.decompress(path.read_bytes()))
        return CompiledFigures({k: int(entry["stats"][k]) for k in _STATS}, entry["hlo"],
                               cached=True)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zlib.error):
        return None  # missing or damaged: compiled again, and replaced


def _write(path: Path, figures: CompiledFigures) -> None:
    """Atomically (a reader sees a whole entry or none); a cache that cannot be written is
    skipped, as JAX's own is."""
    data = gzip.compress(json.dumps({"stats": figures._stats, "hlo": figures._text}).encode(),
                         compresslevel=6)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# what XLA's GPU compiler logs for a program over the device's memory, which the plan then
# reports as not fitting (with the figures): said once by zjax, not twice by the compiler
_OVER_MEMORY = ("exceeds the base limit", "Can't reduce memory use below")


def compile_for_target(lowered: jax.stages.Lowered, devices: list, *,
                       cache_dir: str | os.PathLike | None = None) -> CompiledFigures:
    """Compile ``lowered`` for the compile-only ``devices`` (a target's), or read the figures
    of the same compile kept earlier.

    Args:
      lowered: the step lowered for a mesh of ``devices``.
      devices: the target's compile-only devices, in the mesh's order.
      cache_dir: where entries are kept (default: ``zjax-targets`` in JAX's compilation
        cache directory, and nothing kept when JAX's persistent cache is off).

    Returns:
      The compile's :class:`CompiledFigures` (memory and scheduled HLO).

    Raises:
      jax.errors.JaxRuntimeError: the compiler refused the program (not kept).
    """
    where, options = _cache_dir(cache_dir), _options(lowered)
    path = (where / f"{_key(lowered, devices, options)}.json.gz"
            if where is not None and options is not None else None)
    if path is not None and (kept := _read(path)) is not None:
        return kept
    with held_stderr(keep=lambda line: not any(m in line for m in _OVER_MEMORY)):
        compiled: Any = lowered.compile()
    mem = compiled.memory_analysis()
    figures = CompiledFigures({k: int(getattr(mem, k)) for k in _STATS}, compiled.as_text(),
                              cached=False)
    if path is not None:
        _write(path, figures)
    return figures
