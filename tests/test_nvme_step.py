"""The optimizer on NVMe in the train step (``zero.offload_optimizer.device: nvme``): equal to
the in-memory step, swap files of the bytes the plan predicts (removed at the end), clear errors
for a bad ``nvme_path`` (failures, kill -9 and checkpoints: ``test_nvme_recovery``)."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from helpers import (
    FP32,
    ROOT,
    assert_trees_close,
    make_tx,
    nvme_overrides,
    zjax_main,
)

import zjax
from zjax import build_step
from zjax.checkpoint import to_canonical
from zjax.config import load_config

SMALL = ["model.n_layers=2", "data.seq_len=32", "data.batch_size=16", "optimizer.clip_norm=0.5",
         "optimizer.warmup_steps=2", "train.steps=10"]


def _steps(overrides, n=5):
    """``(losses, canonical state as numpy, zstep)`` after ``n`` steps of random tokens."""
    cfg = load_config(ROOT / "configs/tiny.yaml", [*SMALL, *overrides])
    zstep = build_step(cfg)
    state = zstep.init(jax.random.key(0))
    rng, losses = np.random.default_rng(0), []
    for _ in range(n):
        batch = rng.integers(0, 256, (16, 33)).astype(np.int32)
        state, metrics = zstep.step(state, zstep.put_batch(batch))
        losses.append(float(metrics["loss"]))
    canonical = jax.tree.map(np.asarray, to_canonical(state, zstep))
    zstep.close()
    return losses, canonical, zstep


def _assert_state_close(actual, expected, *, bf16: bool):
    if not bf16:
        assert_trees_close(actual["params"], expected["params"], **FP32, what="master")
        # nu is ~g^2 (1e-8 and below): its absolute tolerance scales down with it
        assert_trees_close(actual["opt_state"], expected["opt_state"], rtol=FP32["rtol"],
                           atol=1e-9, what="optimizer state")
        return
    assert_trees_close(actual["params"], expected["params"], rtol=1e-3, atol=1e-3,
                       what="master")
    for a, e in zip(jax.tree.leaves(actual["opt_state"]), jax.tree.leaves(expected["opt_state"]),
                    strict=True):  # within 5% of the leaf's largest value
        assert np.abs(a - e).max() <= 0.05 * np.abs(e).max(), (a, e)


SLOW = pytest.mark.slow  # the fast loop keeps stage 3


@pytest.mark.parametrize("overrides", [
    pytest.param(["zero.stage=3", "zero.gather_dtype=float32"], id="stage3"),
    pytest.param(["zero.stage=3"], id="stage3-bf16", marks=SLOW),  # bfloat16 working shards
    pytest.param(["zero.stage=2", "zero.gather_dtype=float32"], id="stage2", marks=SLOW),
    pytest.param(["zero.stage=3", "zero.gather_dtype=float32", "train.grad_accum=2",
                  "zero.offload_param.device=host"], id="grad-accum-param-offload-host",
                 marks=SLOW),
])
def test_nvme_step_matches_the_in_memory_step(tmp_path, overrides):
    """5 steps (global-norm clipping, warmup): losses, master and Adam moments as in memory;
    the swap files are gone after ``close``.

    The host's update rounds like the device's to within an ulp, not bit for bit (another
    fusion; the clip as one factor). In float32 that is ``FP32``. With a bfloat16 working
    copy a master an ulp apart can round to the neighbouring bfloat16 weight: losses move
    by ~3e-5, and Adam, which divides by the root of a near-zero second moment, turns the
    changed gradient of a few elements into a fraction of a learning-rate step (3e-3): there
    the bound is 1e-3, and the moments (gradients computed in bfloat16 from weights that
    differ in a few places) agree to 5% of each leaf's largest value.
    """
    bf16 = "zero.gather_dtype=float32" not in overrides
    mem_losses, mem, _ = _steps(overrides)
    nv_losses, nv, zstep = _steps([*overrides, *nvme_overrides(tmp_path)])
    np.testing.assert_allclose(nv_losses, mem_losses, rtol=1e-4 if bf16 else 1e-5)
    assert int(nv["step"]) == int(mem["step"]) == 5
    _assert_state_close(nv, mem, bf16=bf16)
    assert zstep.nvme.opt is None and not list(tmp_path.iterdir())


def test_swap_files_hold_the_bytes_the_plan_predicts(tmp_path):
    """Master + Adam's two moments in float32: 12 bytes per parameter, each process's files
    its devices' distinct shards; ``zjax plan`` says the same per device."""
    cfg = load_config(ROOT / "configs/tiny.yaml",
                      [*SMALL, "zero.param_persistence_threshold=0", *nvme_overrides(tmp_path)])
    zstep = build_step(cfg)
    assert not zstep.plan.replicated  # every leaf sharded: no shard counted twice
    zstep.init(jax.random.key(0))
    files = sum(p.stat().st_size for p in tmp_path.rglob("*.swp"))
    n_params = sum(leaf.size for leaf in zstep.plan.leaves)
    assert files == zstep.nvme.nbytes == 12 * n_params
    report = zjax.plan(cfg)
    assert report.per_device["nvme_bytes"] * 8 == files
    assert report.per_device["host_bytes"] == 0
    assert "on NVMe" in report.table()
    zstep.close()
    assert not list(tmp_path.iterdir())


def _run(overrides, batches, *, seed):
    """A step built from ``overrides`` and initialised with ``seed``; a generator that takes
    one of ``batches`` per ``next`` and yields the loss, then the canonical state."""
    cfg = load_config(ROOT / "configs/tiny.yaml", [*SMALL, *overrides])
    zstep = build_step(cfg)
    state = zstep.init(jax.random.key(seed))
    for batch in batches:
        state, metrics = zstep.step(state, zstep.put_batch(batch))
        yield float(metrics["loss"])
    yield jax.tree.map(np.asarray, to_canonical(state, zstep))
    zstep.close()


@SLOW  # three runs: outside the fast loop
def test_two_runs_sharing_an_nvme_path_do_not_touch_each_other(tmp_path):
    """Two runs of one config (the same swap-file names) on one ``nvme_path``, stepped in
    turn: the first run's losses and final state are bitwise those of the same run alone."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (16, 33)).astype(np.int32) for _ in range(4)]
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    alone.mkdir()
    shared.mkdir()
    *expected_losses, expected = _run(nvme_overrides(alone), batches, seed=0)
    first = _run(nvme_overrides(shared), batches, seed=0)
    second = _run(nvme_overrides(shared), batches[::-1], seed=1)
    losses = []
    for _ in batches:
        losses.append(next(first))
        next(second)
    assert losses == expected_losses
    state = next(first)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(x, y)
    next(second)
    for run in (first, second):
        assert next(run, None) is None  # closed: its swap files removed
    assert not list(shared.iterdir())


def test_bad_nvme_input_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """Missing, not a directory, too little free space (checked when the swap files are
    created: at init or restore, before the step compiles), an optimizer that is not
    elementwise, params on NVMe without the optimizer there: a ConfigError naming the key
    (and path and bytes)."""
    base = load_config(ROOT / "configs/tiny.yaml", SMALL)

    def start(path):
        zstep = build_step(load_config(ROOT / "configs/tiny.yaml",
                                       [*SMALL, *nvme_overrides(path)]))
        return zstep.init(jax.random.key(0))

    for path, match in [(tmp_path / "absent", r"nvme_path: '.*absent' does not exist.* GiB"),
                        (ROOT / "README.md", r"nvme_path: '.*README.md' is not a directory")]:
        with pytest.raises(zjax.ConfigError, match=match):
            start(path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(zjax.ConfigError, match=r"has 0.00 GiB free, but the swap files need"):
        start(tmp_path)
    monkeypatch.undo()
    zero = load_config(ROOT / "configs/tiny.yaml", [*SMALL, *nvme_overrides(tmp_path)]).zero
    with pytest.raises(zjax.ConfigError, match="not elementwise"):  # optax's clip inside tx
        zjax.make_step(zjax.task.loop.resolve_loop("lm").trainable(base.model), make_tx(),
                       zero=zero, mesh=zjax.make_mesh())
    with pytest.raises(zjax.ConfigError, match=r"zero.offload_param.device: nvme needs "
                                               r"zero.offload_optimizer.device: nvme"):
        load_config(ROOT / "configs/tiny.yaml", [*SMALL, "zero.offload_param.device=nvme"])
    assert not list(tmp_path.iterdir())


def test_cli_exits_2_naming_the_path(tmp_path):
    proc = zjax_main("train", "configs/tiny.yaml", *SMALL, *nvme_overrides(tmp_path / "nope"),
                     "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "zero.offload_optimizer.nvme_path:" in proc.stderr and "nope" in proc.stderr
    assert "Traceback" not in proc.stderr
