"""The suite's own machinery (issue 68): a crashed worker ends the run at once, naming its
test, which is not run again; a worker gives back its compiled programs' memory mappings after
each file; the ledger says which files grew."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mappings
import pytest
from ledger import grown

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import crash_stop
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    crash_stop.no_worker_replacement(config)


def pytest_configure(config):
    crash_stop.install(config)
"""


@pytest.mark.slow
def test_a_worker_that_dies_ends_the_run_naming_its_test_once(tmp_path):
    """Two workers, one file each: ``test_dies`` crashes its own worker (a segmentation
    fault, as XLA's) while the other worker is in a file of 30 one-second tests. The run ends
    non-zero within a minute, names ``test_dies`` as the test that crashed with the stack it
    died in, runs it once, and the other worker stops after the test it was in."""
    # subprocess: the pytest run whose worker dies is what the test tests
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a_dies.py").write_text(textwrap.dedent(f"""
        import ctypes, time

        def test_dies():
            with open({str(tmp_path / 'ran')!r}, "a") as f:
                f.write("dies\\n")
            time.sleep(2)  # the other worker is into its file
            ctypes.string_at(0)  # reads address 0: SIGSEGV
    """))
    (tmp_path / "test_b_long.py").write_text(textwrap.dedent("""
        import time
        import pytest

        @pytest.mark.parametrize("i", range(30))
        def test_one_second(i):
            time.sleep(1)
    """))
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-n", "2", "--dist", "loadfile", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert took < 60, (took, out)
    # named (the failure and, untruncated where CI is set, the summary line both name it);
    # one worker went down and one test failed: nothing replaced it to crash again
    assert "crashed while running 'test_a_dies.py::test_dies'" in out, out
    # the crashing thread's stack, in the FAILURES section (before the summary)
    failures = out[out.index("= FAILURES ="):out.index("short test summary")]
    assert "Fatal Python error: Segmentation fault" in failures, out
    assert "line 8 in test_dies" in failures, out
    assert out.count("node down:") == 1, out
    assert "1 failed" in out, out
    assert (tmp_path / "ran").read_text() == "dies\n"  # run once, never again
    assert "replacing crashed worker" not in out, out
    assert "30 passed" not in out, out  # the other worker stopped early


def test_a_file_s_compiled_programs_give_back_their_mappings():
    """Each program XLA:CPU compiles holds memory mappings; what a worker does after each file
    (tests/mappings.py: JAX's caches dropped) gives them back, so a long-lived worker never
    nears the kernel's limit, where XLA:CPU segfaults."""
    import jax
    import jax.numpy as jnp

    def compile_60(offset: int) -> list:
        programs = [jax.jit(lambda x, k=k: jnp.sin(x) * k) for k in range(offset, offset + 60)]
        jax.block_until_ready([f(jnp.ones(4)) for f in programs])
        return programs

    compile_60(0)  # XLA:CPU's thread pools grow to their size (each thread: a stack, 2 maps)
    mappings.release()
    before = mappings.count()
    programs = compile_60(1000)
    held = mappings.count() - before
    assert held >= 120, held  # 3 to 6 per program: its object files' sections
    mappings.release()  # the functions are still referenced: their executables go anyway
    assert mappings.count() - before < held / 4, (before, held, mappings.count())
    assert programs


AT_THE_LIMIT = """
import mmap, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, mappings
jax.config.update("jax_compilation_cache_dir", {cache!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jnp.ones(3).block_until_ready()
held, target = [], mappings.limit() - 300
while (need := target - mappings.count()) > 0:  # (a count reads 65,000 lines: rarely)
    for i in range(need):  # alternate protections: the kernel cannot merge them
        prot = mmap.PROT_READ if i % 2 else mmap.PROT_READ | mmap.PROT_WRITE
        held.append(mmap.mmap(-1, 4096, prot=prot))
print("held", mappings.count(), flush=True)
for k in range(400):
    jax.jit(lambda x, k=k: (jnp.tanh(x * (k + 1)) @ x.T).sum())(jnp.ones((3, 5 + k)))
print("survived", flush=True)
"""


@pytest.mark.slow
def test_at_the_mapping_limit_xla_cpu_dies_where_the_workers_died(tmp_path):
    """The cause of the workers' deaths (tests/mappings.py), shown: a process 300 mappings
    short of ``vm.max_map_count`` compiling small programs for JAX's cache dies of a
    segmentation fault in ``Executable.serialize``, after LLVM's "Cannot allocate memory".
    (If a later jaxlib fails cleanly instead, this fails: the mitigation's reason is gone.)"""
    # subprocess: the process dies
    if mappings.limit() is None:
        pytest.skip("no /proc/sys/vm/max_map_count on this system")
    program = AT_THE_LIMIT.format(tests=str(TESTS), cache=str(tmp_path))
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", program],
                            capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert "held" in result.stdout, out[-3000:]
    assert "survived" not in result.stdout, out[-3000:]
    assert result.returncode == -11, (result.returncode, out[-3000:])  # SIGSEGV
    assert "Cannot allocate memory" in out, out[-3000:]
    assert "in put_executable_and_time" in out, out[-3000:]  # serialize, for the cache


def test_the_ledger_names_files_grown_by_20_percent_and_30_seconds():
    ledger = {"a.py": 100.0, "b.py": 100.0, "c.py": 10.0, "d.py": 200.0}
    measured = {"a.py": 119.0, "b.py": 140.0, "c.py": 39.0, "d.py": 235.0, "e.py": 245.0,
                "new.py": 31.0, "small.py": 29.0}
    ledger["e.py"] = 200.0
    assert grown(measured, ledger) == [("e.py", 245.0, 200.0), ("b.py", 140.0, 100.0),
                                       ("new.py", 31.0, 0.0)]


PROGRAM = """
import jax, jax.numpy as jnp
from jax._src import monitoring
seen = []
monitoring.register_event_listener(lambda e, **k: seen.append(e))
jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((8, 8))).block_until_ready()
print("hits", sum(e.endswith("cache_hits") for e in seen),
      "misses", sum(e.endswith("cache_misses") for e in seen))
"""


@pytest.mark.slow
def test_processes_with_another_device_count_never_read_each_other_s_entries(tmp_path):
    """The cache key covers XLA_FLAGS, so a process simulating 4 devices compiles afresh
    what one simulating 8 wrote, and a second 8-device process reads it back."""
    # subprocess: the simulated device count is a process's
    import os

    def run(devices: int) -> str:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "true",
               "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                             text=True, timeout=300)
        return out.stdout.strip().splitlines()[-1]

    first, other, again = run(8), run(4), run(8)
    assert first.startswith("hits 0 ") and not first.endswith(" misses 0"), first
    assert other.startswith("hits 0 "), other
    assert again.endswith(" misses 0"), again


def test_cache_entries_are_written_whole(tmp_path):
    """The suite's writes go through a temporary file renamed into place (compile_cache)."""
    from jax._src.lru_cache import LRUCache

    cache = LRUCache(str(tmp_path), max_size=-1)
    written = []
    real = os.replace

    def spy(src, dst):
        written.append((Path(src).name, Path(dst).name, Path(src).read_bytes()))
        real(src, dst)

    os.replace = spy
    try:
        cache.put("key", b"x" * 1000)
        cache.put("key", b"y")  # an entry is never replaced
    finally:
        os.replace = real
    assert [(d, len(data)) for _, d, data in written] == [("key-cache", 1000)]
    assert written[0][0].startswith(".key-cache.")
    assert cache.get("key") == b"x" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key-cache"]


@pytest.mark.default_emitters
def test_a_default_emitters_test_runs_under_the_default_emitters():
    """The suite compiles with XLA:CPU's older fusion emitters; a test marked
    ``default_emitters`` runs in a child whose XLA_FLAGS turn them back on (tests/emitters.py)."""
    import jax

    flags = os.environ["XLA_FLAGS"]
    assert "--xla_cpu_use_fusion_emitters=true" in flags, flags
    assert "--xla_cpu_use_fusion_emitters=false" not in flags, flags
    assert jax.device_count() == 8  # the same simulated devices as the parent


def _step_jit_options() -> dict:
    """The compiler options of the tiny GPT's train step's ``jax.jit``, as lowered (as the
    targets' cache reads them: values as strings)."""
    import zjax
    from zjax.runtime._target_cache import _options

    config = zjax.load_config("configs/tiny.yaml", ["model.n_layers=1", "data.path="])
    return dict(_options(zjax.build_step(config).lower(zjax.abstract_batch(config))))


@pytest.mark.long_training
def test_a_long_training_compiles_its_train_step_at_o2():
    """tests/optimized.py: the step's jit carries -O2 (over the suite's XLA_FLAGS -O0)."""
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    assert _step_jit_options().get("xla_backend_optimization_level") == "2"


def test_other_tests_compile_their_train_step_at_the_suite_s_level():
    """The CPU record is restored after a long_training test (this file runs one above)."""
    assert "xla_backend_optimization_level" not in _step_jit_options()
