"""Test setup: 8 simulated CPU devices, set before jax creates its backends, and one
compilation cache for the whole run."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# compile-only TPU targets in both pytest workers and their subprocesses (no TPU here)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# JAX's persistent compilation cache, shared by both pytest workers and every subprocess a
# test starts (through the environment): many tests compile the same step (the tiny GPT's,
# trained by the CLI again and again), and the cache turns each repeat into a read. The key
# is the HLO without its metadata, the options and the devices, so a hit is the program a
# compile would give. The pytest process that loads this first makes the directory (the
# workers inherit it) and removes it at exit; a directory set by the caller is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="zjax-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# XLA:CPU's LLVM at -O1: the tests' steps compile faster and run about as fast (serially,
# test_equivalence 95 -> 71 s, a 60-step llama training plus test_train 75 -> 67 s; -O0
# compiles faster still but runs slower: 63 and 106 s). Only the machine code changes: HLO
# passes and buffer assignment are the same, so memory and collective figures are too
# (checked at -O0: the long-context probe's temp is the same to the byte on cpu and h100:8,
# and to the MB on v5p:2x2x2, whose compile time libtpu does not change).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=1").strip()

from zjax.runtime import quiet_plugins

quiet_plugins()  # imports jax, its plugins' start-up lines held back; backends start later

from zjax.runtime.mesh import simulate_cpu_devices  # noqa: E402

# XLA_FLAGS' device count and PJRT_NPROC (room for collectives in flight), inherited by the
# subprocesses tests start.
simulate_cpu_devices(8)


@pytest.fixture
def cli_logging():
    """Undo what an in-process ``cli.main`` does to the zjax logger (a handler on this test's
    captured stdout, which later tests' log lines would hit once it is closed)."""
    import logging

    logger = logging.getLogger("zjax")
    saved = logger.handlers[:], logger.propagate, logger.level
    yield
    logger.handlers[:], logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])
