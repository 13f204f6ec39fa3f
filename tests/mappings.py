"""A worker's memory mappings kept below the kernel's limit (``vm.max_map_count``).

Every executable XLA:CPU compiles maps its object files into memory (about three mappings
each), and one that a test, a fixture or JAX's caches still hold stays mapped. A pytest worker
lives for half the suite and compiles thousands of programs; serializing one for JAX's
persistent cache links its objects again, into mappings of their own. When a process reaches
``vm.max_map_count`` (65,530 by default), LLVM's allocation fails ("LLVM compilation error:
Cannot allocate memory") and XLA:CPU then dies of a segmentation fault, in
``Executable.serialize`` or a compile: the worker deaths of 2026-12-06 and 2026-12-07
(docs/testing.md, "Compilation cache"). So after each test file a worker drops JAX's caches
of compiled programs (``jax.clear_caches``; what the file's tests and module fixtures held
is unmapped once they are gone, and a later file compiling the same program reads it from the
persistent cache), and the run records the most mappings one process held at the end of a
file (counted before the drop: JAX's caches only grow until then), for the ledger.
"""

from __future__ import annotations

import gc

import pytest

__all__ = ["count", "install", "limit", "release"]

_KEY = "zjax_mappings_peak"


def count() -> int:
    """This process's memory mappings (lines of ``/proc/self/maps``); 0 where there is none."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def limit() -> int | None:
    """The kernel's limit on a process's mappings, or None where it cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def release() -> None:
    """Drop JAX's caches of compiled programs and collect: the executables nothing else
    holds are freed, their mappings with them."""
    import jax

    jax.clear_caches()
    gc.collect()


class Mappings:
    """The plugin: at the end of each file the mappings counted, then JAX's caches dropped
    (a worker); the workers' peaks gathered (the controller)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.peak = 0
        self.where = ""

    def _note(self, where: str) -> None:
        now = count()
        if now > self.peak:
            self.peak, self.where = now, where

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None):
        last = nextitem is None or nextitem.path != item.path
        if last:  # the file's most: JAX's caches only grow until release (one read a file:
            self._note(item.nodeid)  # /proc/self/maps at 20,000 mappings takes 30 ms)
        yield  # the module's fixtures are torn down when its last test's teardown ends
        if last:
            release()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        worker = getattr(self.config, "workeroutput", None)
        if worker is not None:
            worker[_KEY] = (self.peak, self.where)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        peak, where = getattr(node, "workeroutput", {}).get(_KEY, (0, ""))
        if peak > self.peak:
            self.peak, self.where = peak, where

    def summary(self) -> str | None:
        """One line for the ledger's block: the peak against the limit."""
        if not self.peak:
            return None
        cap = limit()
        of = f" of {cap:,} (vm.max_map_count)" if cap else ""
        return f"memory mappings: at most {self.peak:,}{of} in one process, after {self.where}"


def install(config: pytest.Config) -> Mappings:
    """Register the plugin (``pytest_configure``) and return it."""
    plugin = Mappings(config)
    config.pluginmanager.register(plugin, "zjax-mappings")
    return plugin

