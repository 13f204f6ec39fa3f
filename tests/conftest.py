"""Test setup: 8 simulated CPU devices, set before jax creates its backends, and a
compilation cache kept between runs."""

import gc
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import compile_cache
import crash_stop
import emitters
import ledger
import mappings
import pytest
from optimized import _long_training  # noqa: F401 (the long_training marker's fixture)

CACHE_LIMIT_BYTES = 4 << 30


def _last_use(f: Path) -> float:
    st = f.stat()  # a read updates the access time (at least daily, under relatime)
    return max(st.st_atime, st.st_mtime)


def _persistent_cache_dir() -> str:
    """``<user cache dir>/zjax/jit-cache-jax-X-jaxlib-Y``: kept between runs, per version,
    trimmed to :data:`CACHE_LIMIT_BYTES` (the least recently used entries go first)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    try:
        versions = f"jax-{version('jax')}-jaxlib-{version('jaxlib')}"
    except PackageNotFoundError:  # pytest from outside the project's environment
        raise pytest.UsageError("jax is not installed in this Python: run the tests as the "
                                "README says (pip install -e '.[test]' in a virtual "
                                "environment, then python -m pytest -q)") from None
    path = Path(base) / "zjax" / f"jit-cache-{versions}"
    if "PYTEST_XDIST_WORKER" not in os.environ and path.is_dir():  # once, before any worker
        entries = sorted((_last_use(f), f.stat().st_size, f) for f in path.rglob("*")
                         if f.is_file())  # with zjax-targets/ (the targets' compiles)
        total = sum(size for _, size, _ in entries)
        for _, size, f in entries:
            if total <= CACHE_LIMIT_BYTES:
                break
            f.unlink(missing_ok=True)
            total -= size
    return str(path)


os.environ.setdefault("JAX_PLATFORMS", "cpu")
# compile-only TPU targets in both pytest workers and their subprocesses (no TPU here)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# JAX's persistent compilation cache, shared by both pytest workers, every subprocess a test
# starts (through the environment) and every later run on this machine: many tests compile the
# same step, and a second run's compiles become reads (docs/testing.md: cold and warm times).
# The key is the HLO without its metadata, the options and the devices, so a hit is the
# program a compile would give. One directory per jax/jaxlib version under the user's cache
# directory (XDG_CACHE_HOME, else ~/.cache), trimmed to 4 GiB at the start of a run (not
# jax_compilation_cache_max_size: its eviction fails on any entry written without it); a
# JAX_COMPILATION_CACHE_DIR set by the caller wins, untouched.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _persistent_cache_dir()
# Every compile is kept, the small ones too: a warm test_packing with test_hsdp takes 16 s
# instead of 23 (0.2 s and up kept), and the cold run no longer (43 s either way).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# JAX's cache of XLA:CPU executables is on. Three times a worker died in XLA:CPU with it on
# (2026-12-06 and -07, in Executable.serialize or a compile): a process that reaches the
# kernel's limit of memory mappings (vm.max_map_count, 65,530) makes LLVM's allocation fail,
# and XLA:CPU then segfaults; a worker keeps every program it compiled, each holding its object
# files' mappings (34,000 in one worker 23 minutes into a cold run), and serializing one for the
# cache maps it again. A worker now gives them back after each file (mappings.py) and the
# ledger prints the most any process held. Entries are written whole (compile_cache.py: JAX
# writes them in place, unlocked), and the key covers XLA_FLAGS, so processes with another
# simulated device count never read each other's (tests/test_suite_mechanics.py).
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "true")

# XLA:CPU's LLVM at -O0: most of a cold run is XLA:CPU compiling thousands of distinct small
# steps that then run a few times, so a faster compile beats faster code (the whole suite
# cold on 2 cores: 20:31 at -O1, 19:00 at -O0 with 8 tests more; -O0 compiles about 30%
# faster, the tiny steps run about 1.6x slower, which only the long trainings feel: those
# marked long_training build their steps at -O2, tests/optimized.py). Only the
# machine code changes: HLO passes, schedule and buffer assignment are the same, so memory and
# collective figures are too (tests/test_target_cache.py compares them). Every process of a
# run, subprocesses included (cli_env), compiles at the same level, so bitwise comparisons
# between them hold.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
# And XLA:CPU's older fusion emitters (tests/emitters.py): three train steps compile in 3.1 s
# instead of 7.8 at -O0, and the whole suite cold took 32 min instead of 49 (2 cores,
# 2026-12-07, every test passing). They fuse differently, so CPU memory figures are those of
# this compiler, not the default one's; the accelerator targets' figures are untouched (their
# own compilers). Tests marked default_emitters run in a child under the default emitters.
os.environ["XLA_FLAGS"] = emitters.with_older_emitters(os.environ.get("XLA_FLAGS", ""))

from zjax.runtime import quiet_plugins  # noqa: E402 (after the environment above)

quiet_plugins()  # imports jax, its plugins' start-up lines held back; backends start later
compile_cache.atomic_writes()

from zjax.runtime.mesh import simulate_cpu_devices  # noqa: E402

# Python's cyclic collector: tracing makes millions of short-lived objects, and each full
# collection walks the whole heap (jax, flax, the test modules). The modules imported so far
# are moved out of its reach and collections run a tenth as often: about 2% less CPU time on
# test_equivalence + test_hsdp + test_packing, cold (136 -> 132 s and 135 -> 132 s).
gc.freeze()
gc.set_threshold(20_000, 50, 100)

# XLA_FLAGS' device count and PJRT_NPROC (room for collectives in flight), inherited by the
# subprocesses tests start.
simulate_cpu_devices(8)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Two pytest-xdist workers, one test file each at a time (module fixtures run once), the
    slowest files first (this file's order, not xdist's by number of tests), unless the
    command line says otherwise (``-n 0``: serially). Set here rather than in ``addopts``:
    without xdist installed, ``-n`` there made pytest refuse the command line and collect
    nothing. (Runs before xdist's own hook: a conftest registers after the plugin. A worker
    runs this file too, and must not start workers of its own.)"""
    worker = hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ
    if config.pluginmanager.hasplugin("xdist") and not worker:
        crash_stop.no_worker_replacement(config)  # a crash ends the run (crash_stop.py)
        if config.option.numprocesses is None:
            config.option.numprocesses = 2
            if config.option.dist == "no":
                config.option.dist = "loadfile"
                config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``default_emitters`` test runs in a child pytest (tests/emitters.py)."""
    if emitters.runs_elsewhere(pyfuncitem):
        emitters.run_under_default_emitters(pyfuncitem)
        return True
    return None


def pytest_configure(config):
    crash_stop.install(config)
    held = mappings.install(config)  # a worker's compiled programs given back after each file
    # the closing block: wall time against the budget, files grown, the most mappings held
    ledger.install(config, notes=[held.summary])


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


@pytest.fixture(scope="session")
def gpt_reference():
    """Five token batches and the tiny GPT's single-device optax run on them (params, optimizer
    state, losses): the reference that test_equivalence, test_hpz and test_hsdp compare
    sharded training with, computed once per worker. Read only."""
    from helpers import make_tx, reference_run
    from models import gpt_reference_loss, gpt_trainable, token_batches

    batches = token_batches(5)
    return batches, reference_run(gpt_trainable().init, gpt_reference_loss(), make_tx(), batches)


def pytest_collection_modifyitems(config, items):
    """The slowest files first, so that the two workers (``--dist loadfile
    --no-loadscope-reorder``) end together: the last files handed out are short ones. A file
    weighs the measured seconds of its selected tests (``tests/test_seconds.json``, written by
    ``tests/census.py``; a test not measured yet counts as the median). The order within a
    file is kept (a stable sort of a list grouped by file)."""
    table = Path(__file__).with_name("test_seconds.json")
    seconds = json.loads(table.read_text()) if table.is_file() else {}
    default = sorted(seconds.values())[len(seconds) // 2] if seconds else 0.0
    weight: dict[Path, float] = {}
    for item in items:
        weight[item.path] = weight.get(item.path, 0.0) + seconds.get(item.nodeid, default)
    items.sort(key=lambda item: -weight[item.path])
