"""The NVMe optimizer engine (``zjax.offload.nvme``): master params and optax moments in swap
files, updated on the host by streamed sub-groups. Equal to optax in memory, swap files of
exactly the state's bytes (removed at close), clear errors for a bad ``nvme_path``, and host
memory bounded by the buffers while the state on disk is many times larger."""

from __future__ import annotations

import itertools
import logging
import os
import select
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import numpy as np
import optax
import pytest
from helpers import FP32, ROOT, assert_trees_close, cli_env

import zjax
from zjax.config import OptimizerConfig
from zjax.offload import NvmeStore
from zjax.offload.nvme import StreamingOptimizer
from zjax.step.optim import make_optimizer


def _arrays(rng, sizes):
    return {k: rng.standard_normal(n).astype(np.float32) for k, n in sizes.items()}


@pytest.mark.parametrize(("name", "clip", "sub"), [("adamw", None, 64), ("adam", 0.5, 100),
                                                   ("sgd", None, 1000)])
def test_streaming_update_matches_optax_in_memory(tmp_path, name, clip, sub):
    """5 steps of zjax's optimizer (schedule, weight decay, global-norm clipping) on arrays
    whose sizes the sub-groups do not divide: master, moments and step counts as optax's."""
    cfg = OptimizerConfig(name=name, lr=1e-2, warmup_steps=3, clip_norm=clip)
    reference = make_optimizer(cfg, total_steps=10)
    elementwise = make_optimizer(OptimizerConfig(name=name, lr=1e-2, warmup_steps=3,
                                                 clip_norm=None), total_steps=10)
    rng = np.random.default_rng(0)
    sizes = {"blocks.w.0": 1000, "embed.0": 77, "ln.3": 1}
    params = _arrays(rng, sizes)
    opt = StreamingOptimizer(elementwise, sizes, tmp_path, sub_group_size=sub, buffer_count=2)
    opt.write_initial(params)
    ref_params, ref_state = dict(params), reference.init(params)
    got = {k: np.empty(n, np.float32) for k, n in sizes.items()}

    def sink(key, start, values):
        got[key][start:start + values.size] = values

    for _ in range(5):
        grads = _arrays(rng, sizes)
        updates, ref_state = reference.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values())))
        opt.update(grads, sink, grad_scale=1.0 if clip is None else min(1.0, clip / norm))
    masters = {k: opt.read(k) for k in sizes}
    assert_trees_close(masters, ref_params, **FP32, what="master")
    assert_trees_close(got, ref_params, **FP32, what="params sent to the sink")
    moments = [p for p in opt.parts if p != "master"]
    ref_moments = [x for x in jax_leaves(ref_state) if isinstance(x, dict)]
    assert len(moments) == len(ref_moments) == (0 if name == "sgd" else 2)
    for part, ref in zip(moments, ref_moments, strict=True):
        assert_trees_close({k: opt.read(k, part) for k in sizes}, ref, **FP32, what=part)
    assert all(int(c) == 5 for c in opt.scalars)
    opt.close()


def jax_leaves(state):
    """optax state leaves, with per-parameter dicts kept whole."""
    import jax

    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dict))


def test_an_optimizer_that_is_not_elementwise_is_refused(tmp_path):
    """zjax's default optimizer clips by the global norm: per sub-group that would clip by
    the wrong norm, silently. It is refused, and nothing is written."""
    tx = make_optimizer(OptimizerConfig(clip_norm=1.0), total_steps=10)
    with pytest.raises(zjax.ConfigError, match=r"not elementwise .*clip_by_global_norm"):
        StreamingOptimizer(tx, {"a": 100}, tmp_path)
    assert not list(tmp_path.iterdir())


def test_swap_files_hold_the_state_bytes_and_are_removed(tmp_path):
    sizes = {"a": 1000, "b": 3}
    tx = optax.adam(1e-3)
    opt = StreamingOptimizer(tx, sizes, tmp_path, sub_group_size=128)
    files = list(tmp_path.rglob("*.swp"))
    assert len(files) == 2 * 3  # master and two moments each
    assert {f.parent for f in files} == {opt.store.path}  # the store's own directory
    assert opt.store.path.parent == tmp_path
    assert sum(f.stat().st_size for f in files) == opt.nbytes == 1003 * 3 * 4
    opt.close()
    assert not list(tmp_path.iterdir())


def test_a_bad_nvme_path_is_a_clear_error(tmp_path):
    tx = optax.adam(1e-3)
    key = "zero.offload_optimizer.nvme_path"
    with pytest.raises(zjax.ConfigError, match=rf"{key}: '.*missing' does not exist"):
        StreamingOptimizer(tx, {"a": 10}, tmp_path / "missing", key=key)
    (tmp_path / "file").write_text("x")
    with pytest.raises(zjax.ConfigError, match=rf"{key}: '.*file' is not a directory"):
        StreamingOptimizer(tx, {"a": 10}, tmp_path / "file", key=key)
    with pytest.raises(zjax.ConfigError, match=rf"{key}: .* GiB free, but the swap files "
                                               r"need 393216.00 GiB"):
        StreamingOptimizer(tx, {"a": 2**45}, tmp_path, key=key)
    assert not list(tmp_path.rglob("*.swp"))


def _stream(opt, rng, sizes, steps=3):
    """``steps`` updates of ``opt`` with gradients from ``rng``: the master values."""
    for _ in range(steps):
        opt.update(_arrays(rng, sizes))
    return {k: opt.read(k) for k in sizes}


def test_two_runs_on_one_path_never_share_a_file(tmp_path):
    """Two optimizers with the same array names under one ``nvme_path`` (two runs of one
    config), stepped in turn: the first one's master is bitwise the master it has alone."""
    sizes, tx = {"w.0": 300, "b.0": 7}, optax.adam(1e-2)
    params = _arrays(np.random.default_rng(0), sizes)
    alone_path, shared = tmp_path / "alone", tmp_path / "shared"
    alone_path.mkdir()
    shared.mkdir()
    alone = StreamingOptimizer(tx, sizes, alone_path, sub_group_size=64)
    alone.write_initial(params)
    expected = _stream(alone, np.random.default_rng(1), sizes)
    alone.close()
    first = StreamingOptimizer(tx, sizes, shared, sub_group_size=64)
    second = StreamingOptimizer(tx, sizes, shared, sub_group_size=64)
    assert first.store.path != second.store.path
    first.write_initial(params)
    second.write_initial(_arrays(np.random.default_rng(2), sizes))
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(3)
    for _ in range(3):
        first.update(_arrays(rng_a, sizes))
        second.update(_arrays(rng_b, sizes))
    for k in sizes:
        np.testing.assert_array_equal(first.read(k), expected[k])
    first.close()
    assert second.store.path.is_dir()  # closing one run leaves the other's files
    second.close()
    assert not list(shared.iterdir())


HOLDER = textwrap.dedent("""
    import os, signal, sys, time
    import optax
    from zjax.offload.nvme import StreamingOptimizer

    opt = StreamingOptimizer(optax.adam(1e-3), {"w": 100}, sys.argv[1])
    print(opt.store.path, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: its directory stays
    time.sleep(600)
""")


@pytest.mark.slow  # two interpreters
def test_a_dead_runs_swap_files_are_removed_and_a_live_runs_kept(tmp_path, caplog):
    """A run killed with its swap files on disk, and a run still alive, under one path: the
    next store there removes the dead run's directory (logging whose it was) and leaves the
    live one's alone; a lack of space names the live run that holds it."""
    def holder(mode):
        return subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), mode],
                                stdout=subprocess.PIPE, text=True,
                                env=cli_env(JAX_PLATFORMS="cpu"), cwd=ROOT)

    def first_line(proc) -> Path:  # its swap directory, within two minutes
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the holder printed no swap directory"
        return Path(proc.stdout.readline().strip())

    live = holder("live")  # first: its own store would remove the dead one's directory
    try:
        live_dir = first_line(live)
        dead = holder("die")
        dead_dir = first_line(dead)
        dead.wait(timeout=120)
        assert dead_dir.is_dir() and live_dir.is_dir() and dead_dir != live_dir
        before = {f.name: f.read_bytes() for f in live_dir.iterdir()}
        with caplog.at_level(logging.INFO, logger="zjax"):
            opt = StreamingOptimizer(optax.adam(1e-3), {"w": 100}, tmp_path)
        assert not dead_dir.exists()
        assert f"pid {dead.pid} " in caplog.text and str(dead_dir) in caplog.text
        assert {f.name: f.read_bytes() for f in live_dir.iterdir()} == before
        opt.close()
        usage = shutil.disk_usage(tmp_path)
        with mock.patch.object(shutil, "disk_usage", lambda p: usage._replace(free=1000)), \
                pytest.raises(zjax.ConfigError, match=rf"another run's swap files hold space "
                                                      rf"there \(pid {live.pid} on "):
            StreamingOptimizer(optax.adam(1e-3), {"w": 10**6}, tmp_path)
    finally:
        live.kill()
        live.wait(timeout=60)
    StreamingOptimizer(optax.adam(1e-3), {"w": 100}, tmp_path).close()  # now it is dead too
    assert not list(tmp_path.iterdir())


BOUNDED = textwrap.dedent("""
    import sys
    import numpy as np, optax
    from zjax.offload.nvme import StreamingOptimizer

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024

    class Ones:  # a gradient that is never whole in memory
        def __getitem__(self, s): return np.full(s.stop - s.start, 1e-3, np.float32)

    n, sub = int(sys.argv[2]), 1 << 18
    opt = StreamingOptimizer(optax.adam(1e-3), {"w": n}, sys.argv[1], sub_group_size=sub,
                             buffer_count=4)
    z = np.zeros(sub, np.float32)  # compile the sub-group's update and init first
    opt._chunk.fn(z, z, opt._chunk.init(z), opt.scalars, np.float32(1))
    base = hwm()
    opt.write_initial({"w": Ones()})
    for _ in range(2):
        opt.update({"w": Ones()})
    print(opt.nbytes, hwm() - base)
    opt.close()
""")


@pytest.mark.slow
def test_host_memory_depends_on_the_buffers_not_the_state(tmp_path):
    """Sub-groups of 256K elements, 4 buffers (12 MB of master and moments in flight each
    way): writing the initial state and two streamed updates raise the peak RSS by about
    50 MB for both 10M and 40M parameters (120 and 480 MB on disk, 10 and 40 times the
    buffers). Bounds with room for a loaded machine: the two differ by less than a tenth of
    the larger state (holding one array whole would add 160 MB), and stay under 4x the
    buffers in flight (the sub-group's copies and the allocator's retention)."""
    grew = {}
    for n in (10_000_000, 40_000_000):
        # without the tests' compilation cache, as a user runs: a cold cache's writes of the
        # update's executables land in the measured peak (about 50 MB more at 40M)
        r = subprocess.run([sys.executable, "-c", BOUNDED, str(tmp_path), str(n)], cwd=ROOT,
                           env=cli_env(JAX_COMPILATION_CACHE_DIR=None), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        state, grew[n] = map(int, r.stdout.split())
        assert state == n * 12
    in_flight = 2 * 4 * 3 * (1 << 18) * 4
    assert abs(grew[40_000_000] - grew[10_000_000]) < 40_000_000 * 12 / 10, grew
    assert grew[40_000_000] < 4 * in_flight, (grew, in_flight)


def _direct_io_here(path: Path) -> bool:
    probe = path / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def test_ranges_round_trip_through_direct_and_cached_pages(tmp_path):
    """Ranges at every alignment, written and read concurrently (pages whole by O_DIRECT,
    partial pages and unaligned memory through the page cache), read back as written; the
    whole pages moved by O_DIRECT where the filesystem has it."""
    rng = np.random.default_rng(0)
    size = 300_000
    store = NvmeStore(tmp_path, {"a": size, "b": 1}, threads=3)
    ref = np.zeros(size, np.float32)
    cuts = np.unique(np.concatenate([[0, size], rng.integers(0, size, 40),
                                     np.arange(0, size, 1024)[::37]]))  # some page-aligned
    pending = []
    for start, stop in itertools.pairwise(cuts):
        values = rng.standard_normal(stop - start + 1).astype(np.float32)
        values = values[1:] if start % 2 else values[:-1]  # memory off the page, or not
        ref[start:stop] = values
        pending.append(store.write("a", int(start), values))
    for f in pending:
        f.result()
    store.write_now("b", 0, np.float32([7.0]))
    reads = [(int(a), int(rng.integers(a, size + 1))) for a in rng.integers(0, size, 30)]
    futures = [store.read("a", a, b - a) for a, b in reads]
    for (a, b), f in zip(reads, futures, strict=True):
        np.testing.assert_array_equal(f.result(), ref[a:b])
        np.testing.assert_array_equal(store.read_now("a", a, b - a), ref[a:b])
    assert store.read_now("b", 0, 1)[0] == 7.0
    if _direct_io_here(tmp_path):
        assert store.direct_bytes > (size * 4 + sum(b - a for a, b in reads) * 8) // 2
    store.close()


def test_an_update_taken_range_by_range_equals_the_whole_one(tmp_path):
    """The streamed step hands the update each layer's gradients as the backward makes them:
    ranges in any order, split anywhere, give the master, moments and counts of one whole
    update, bit for bit."""
    rng = np.random.default_rng(1)
    sizes = {"w": 1000, "b": 37}
    tx = optax.adamw(1e-2, weight_decay=0.1)
    params, grads = _arrays(rng, sizes), _arrays(rng, sizes)
    (tmp_path / "whole").mkdir()
    (tmp_path / "parts").mkdir()
    whole = StreamingOptimizer(tx, sizes, tmp_path / "whole", sub_group_size=64)
    parts = StreamingOptimizer(tx, sizes, tmp_path / "parts", sub_group_size=64)
    for opt in (whole, parts):
        opt.write_initial(params)
    whole.update(grads, grad_scale=0.5)
    run = parts.begin(grad_scale=0.5)
    for name, a, b in [("w", 700, 1000), ("b", 0, 37), ("w", 0, 333), ("w", 333, 700)]:
        run.ranges([(name, a, b - a)], lambda n, s, k: grads[n][s:s + k])
    assert run.finish().finite
    for name in sizes:
        for part in whole.parts:
            np.testing.assert_array_equal(parts.read(name, part), whole.read(name, part))
    assert [int(c) for c in parts.scalars] == [int(c) for c in whole.scalars] == [1]
    whole.close()
    parts.close()

