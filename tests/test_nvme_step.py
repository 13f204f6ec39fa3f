"""The optimizer on NVMe in the train step (``zero.offload_optimizer.device: nvme``): equal to
the in-memory step, swap files of the bytes the plan predicts (removed at the end), checkpoints
that resume bit for bit after kill -9 and across NVMe / in-memory runs, clear errors for a bad
``nvme_path`` or a disk that fails mid-run."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    FP32,
    GRADS,
    ROOT,
    assert_trees_close,
    latest_checkpoint,
    make_tx,
    run_zjax,
    start_zjax,
)

import zjax
from zjax import build_step
from zjax.checkpoint import to_canonical
from zjax.config import load_config

SMALL = ["model.n_layers=2", "data.seq_len=32", "data.batch_size=16", "optimizer.clip_norm=0.5",
         "optimizer.warmup_steps=2", "train.steps=10"]


def _nvme(path: Path, sub: int = 1000) -> list[str]:
    return ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={path}",
            "zero.offload_optimizer.buffer_count=2", f"zero.sub_group_size={sub}"]


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


SLOW = pytest.mark.slow  # the fast loop keeps stage 3 and stage 2


@pytest.mark.parametrize("overrides", [
    pytest.param(["zero.stage=3", "zero.gather_dtype=float32"], id="stage3"),
    pytest.param(["zero.stage=3"], id="stage3-bf16", marks=SLOW),  # bfloat16 working shards
    pytest.param(["zero.stage=2", "zero.gather_dtype=float32"], id="stage2"),
    pytest.param(["zero.stage=3", "zero.gather_dtype=float32", "train.grad_accum=2"],
                 id="grad-accum", marks=SLOW),
    pytest.param(["zero.stage=3", "zero.gather_dtype=float32", "zero.offload_param.device=host"],
                 id="param-offload-host", marks=SLOW),
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
    nv_losses, nv, zstep = _steps([*overrides, *_nvme(tmp_path)])
    np.testing.assert_allclose(nv_losses, mem_losses, rtol=1e-4 if bf16 else 1e-5)
    assert int(nv["step"]) == int(mem["step"]) == 5
    _assert_state_close(nv, mem, bf16=bf16)
    assert zstep.nvme.opt is None and not list(tmp_path.iterdir())


def test_swap_files_hold_the_bytes_the_plan_predicts(tmp_path):
    """Master + Adam's two moments in float32: 12 bytes per parameter, each process's files
    its devices' distinct shards; ``zjax plan`` says the same per device."""
    cfg = load_config(ROOT / "configs/tiny.yaml",
                      [*SMALL, "zero.param_persistence_threshold=0", *_nvme(tmp_path)])
    zstep = build_step(cfg)
    assert not zstep.plan.replicated  # every leaf sharded: no shard counted twice
    zstep.init(jax.random.key(0))
    files = sum(p.stat().st_size for p in tmp_path.iterdir())
    n_params = sum(leaf.size for leaf in zstep.plan.leaves)
    assert files == zstep.nvme.nbytes == 12 * n_params
    report = zjax.plan(cfg)
    assert report.per_device["nvme_bytes"] * 8 == files
    assert report.per_device["host_bytes"] == 0
    assert "on NVMe" in report.table()
    zstep.close()
    assert not list(tmp_path.iterdir())


def test_bad_nvme_input_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """Missing, not a directory, too little free space (checked when the swap files are
    created: at init or restore, before the step compiles), an optimizer that is not
    elementwise, params on NVMe: a ConfigError naming the key (and path and bytes)."""
    base = load_config(ROOT / "configs/tiny.yaml", SMALL)

    def start(path):
        zstep = build_step(load_config(ROOT / "configs/tiny.yaml", [*SMALL, *_nvme(path)]))
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
    zero = load_config(ROOT / "configs/tiny.yaml", [*SMALL, *_nvme(tmp_path)]).zero
    with pytest.raises(zjax.ConfigError, match="not elementwise"):  # optax's clip inside tx
        zjax.make_step(zjax.loop.resolve_loop("lm").trainable(base.model), make_tx(),
                       zero=zero, mesh=zjax.make_mesh())
    with pytest.raises(zjax.ConfigError, match=r"zero.offload_param.device: nvme is not built"):
        load_config(ROOT / "configs/tiny.yaml", [*SMALL, "zero.offload_param.device=nvme"])
    assert not list(tmp_path.iterdir())


def test_cli_exits_2_naming_the_path(tmp_path):
    proc = run_zjax("train", "configs/tiny.yaml", *SMALL, *_nvme(tmp_path / "nope"),
                    "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "zero.offload_optimizer.nvme_path:" in proc.stderr and "nope" in proc.stderr
    assert "Traceback" not in proc.stderr


FAST = ["model.n_layers=2", "data.seq_len=32", "train.log_every=2", "train.eval_every=0",
        "logging.tensorboard=false"]


@pytest.mark.slow
def test_a_disk_failing_mid_run_stops_with_the_path_and_keeps_the_checkpoint(tmp_path,
                                                                              monkeypatch):
    from zjax.offload.nvme import StreamingOptimizer

    nv, run = tmp_path / "nvme", tmp_path / "run"
    nv.mkdir()
    updates, pwrite, update = [0], os.pwrite, StreamingOptimizer.update

    def counted(self, *args, **kwargs):
        updates[0] += 1
        return update(self, *args, **kwargs)

    def failing(fd, data, offset):  # the swap files' writes: os.pwrite
        if updates[0] >= 3:  # the third step, after the checkpoint of step 2
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(StreamingOptimizer, "update", counted)
    monkeypatch.setattr(os, "pwrite", failing)
    cfg = load_config(ROOT / "configs/tiny.yaml",
                      [*FAST, *_nvme(nv), "train.steps=8", "checkpoint.every=2"])
    with pytest.raises(zjax.NvmeError, match=r"nvme_path: writing .*nvme.* No space left"):
        zjax.train("lm", cfg, run_dir=run)
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [2]
    step, _ = latest_checkpoint(run, FAST)  # intact, and it restores in memory
    assert step == 2
    assert not list(nv.iterdir())  # the swap files are removed all the same


def _final_ckpt(run, overrides=()):
    return latest_checkpoint(run, [*FAST, *overrides])


@pytest.mark.slow
def test_kill9_mid_stream_resumes_bit_for_bit(tmp_path):
    """SIGKILL mid-run, after the checkpoint of step 4, inside some later step (where the
    stream may be writing the swap files: they are torn, and never read again); the resumed
    run's final checkpoint equals a straight run's bit for bit; swap files removed at the end.
    """
    args = [*FAST, "train.steps=8", "checkpoint.every=2", "zero.sub_group_size=4096"]
    straight_nv, killed_nv = tmp_path / "nv1", tmp_path / "nv2"
    straight_nv.mkdir()
    killed_nv.mkdir()
    proc = run_zjax("train", "configs/tiny.yaml", *args, *_nvme(straight_nv, 4096),
                    "--run-dir", str(tmp_path / "straight"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NVMe read" in proc.stdout + proc.stderr
    run = tmp_path / "killed"
    proc = start_zjax("train", "configs/tiny.yaml", *args, *_nvme(killed_nv, 4096),
                      "--run-dir", str(run))
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "4").is_dir():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert list(killed_nv.iterdir())  # the killed run's (torn) swap files: never read
    proc = run_zjax("train", "configs/tiny.yaml", *args, *_nvme(killed_nv, 4096),
                    "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from the checkpoint at step" in proc.stdout + proc.stderr
    step, final = _final_ckpt(run)
    step_s, expected = _final_ckpt(tmp_path / "straight")
    assert step == step_s == 8
    for x, y in zip(jax.tree.leaves(final), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not list(killed_nv.iterdir()) and not list(straight_nv.iterdir())


def _damage(step_dir: Path, other: Path) -> None:
    """Replace ``step_dir``'s arrays by ``other``'s: every file reads, but the values are not
    the ones ``step_dir`` recorded."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(other / "state", step_dir / "state")


@pytest.mark.slow
def test_checkpoints_move_between_nvme_and_memory_and_damage_is_seen_both_ways(tmp_path,
                                                                               caplog):
    """An NVMe run's checkpoint resumes in memory, and an in-memory one on NVMe: 6 steps
    either way end as an in-memory run's 6 (GRADS). In both, with step 6 removed, step 4 is
    damaged (step 2's arrays in its place): the in-memory restore of the NVMe-written
    checkpoint and the leaf-by-leaf restore into the swap files both see the checksums, set
    step 4 aside and resume from step 2."""
    nv = tmp_path / "nv"
    nv.mkdir()
    mem = [*FAST, "train.steps=6", "checkpoint.every=2", "zero.gather_dtype=float32"]

    def train(run, *extra):
        cfg = load_config(ROOT / "configs/tiny.yaml", [*mem, *extra])
        return zjax.train("lm", cfg, run_dir=run)

    train(tmp_path / "ref")
    train(tmp_path / "a", *_nvme(nv))
    shutil.copytree(tmp_path / "ref", tmp_path / "b")
    for run, extra in (("a", ()), ("b", _nvme(nv))):  # NVMe -> memory, memory -> NVMe
        ckpts = tmp_path / run / "checkpoints"
        shutil.rmtree(ckpts / "6")
        _damage(ckpts / "4", ckpts / "2")
        caplog.clear()
        with caplog.at_level("INFO", logger="zjax"):
            train(tmp_path / run, *extra)
        assert re.search(r"checkpoint at step 4 .* is damaged \(DamagedCheckpoint: step 4: "
                         r"leaf \S+ reads back other values", caplog.text), caplog.text[-2000:]
        assert "resuming from the checkpoint at step 2" in caplog.text
        assert (tmp_path / run / "damaged-checkpoint-4").is_dir()
    _, ref = _final_ckpt(tmp_path / "ref", ["zero.gather_dtype=float32"])
    for run in ("a", "b"):
        step, got = _final_ckpt(tmp_path / run, ["zero.gather_dtype=float32"])
        assert step == 6
        assert_trees_close(got["params"], ref["params"], **GRADS, what=f"{run}: master")
    assert not list(nv.iterdir())
