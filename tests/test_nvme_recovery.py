"""The optimizer on NVMe when things go wrong: a disk that fails mid-run, kill -9, checkpoints
moved between NVMe and in-memory runs, damaged checkpoints. (Apart from ``test_nvme_step``
so that the two long files run on different workers.)"""

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
    GRADS,
    ROOT,
    assert_trees_close,
    latest_checkpoint,
    nvme_overrides,
    start_zjax,
)

import zjax
from zjax.config import load_config

pytestmark = pytest.mark.slow  # trains and restarts runs: outside the fast loop


FAST = ["model.n_layers=2", "data.seq_len=32", "train.log_every=2", "train.eval_every=0",
        "logging.tensorboard=false"]


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
                      [*FAST, *nvme_overrides(nv), "train.steps=8", "checkpoint.every=2"])
    with pytest.raises(zjax.NvmeError, match=r"nvme_path: writing .*nvme.* No space left"):
        zjax.train("lm", cfg, run_dir=run)
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [2]
    step, _ = latest_checkpoint(run, FAST)  # intact, and it restores in memory
    assert step == 2
    assert not list(nv.iterdir())  # the swap files are removed all the same


def _final_ckpt(run, overrides=()):
    return latest_checkpoint(run, [*FAST, *overrides])


@pytest.mark.parametrize("where", [[], ["zero.offload_param.device=nvme"]],
                         ids=["optimizer", "params"])
def test_kill9_mid_stream_resumes_bit_for_bit(tmp_path, caplog, where):
    """SIGKILL mid-run, after the checkpoint of step 4, inside some later step (where the
    stream may be writing the swap files: they are torn, and never read again); the resumed
    run's final checkpoint equals a straight run's bit for bit; swap files removed at the end.

    Each save of the NVMe state costs seconds (a step, a fraction of one), so the killed run
    checkpoints every 4 steps (the kill lands in step 5 or 6, no save in progress) and the
    straight run only at its end: the resumed run must equal a run that never saved, let
    alone restored, midway. Only the killed run needs a process of its own; the straight and
    the resumed run train here (``zjax train`` is ``zjax.train`` after the flags), which saves
    two process starts. With the parameters on NVMe too (the streamed step) as well.
    """
    args = [*FAST, "train.steps=8", "checkpoint.every=4", "zero.sub_group_size=4096", *where]
    straight_nv, killed_nv = tmp_path / "nv1", tmp_path / "nv2"
    straight_nv.mkdir()
    killed_nv.mkdir()

    def train(nv, run, *extra):
        return zjax.train(None, load_config(ROOT / "configs/tiny.yaml", [
            *args, *nvme_overrides(nv, 4096), *extra]), run_dir=run)

    train(straight_nv, tmp_path / "straight", "checkpoint.every=8")
    assert [p.name for p in (tmp_path / "straight" / "checkpoints").iterdir()
            if p.name.isdigit()] == ["8"]
    run = tmp_path / "killed"
    # subprocess: the run killed with SIGKILL mid-stream (the other two train here)
    proc = start_zjax("train", "configs/tiny.yaml", *args, *nvme_overrides(killed_nv, 4096),
                      "--run-dir", str(run))
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "4").is_dir():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert list(killed_nv.rglob("*.swp"))  # the killed run's (torn) swap files: never read
    caplog.clear()
    with caplog.at_level("INFO", logger="zjax"):
        train(killed_nv, run)
    assert "NVMe read" in caplog.text
    assert "resuming from the checkpoint at step 4" in caplog.text
    assert "removed the swap files of a run that ended without removing them" in caplog.text
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


def test_checkpoints_move_between_nvme_and_memory_and_damage_is_seen_both_ways(tmp_path,
                                                                               caplog):
    """An NVMe run's checkpoint resumes in memory, and an in-memory one on NVMe: 6 steps
    either way end as an in-memory run's 6 (GRADS). In both, step 4, the latest checkpoint,
    is damaged (step 2's arrays in its place): the in-memory restore of the NVMe-written
    checkpoint and the leaf-by-leaf restore into the swap files both see the checksums, set
    step 4 aside and resume from step 2.

    Each NVMe save costs seconds, so the NVMe run trains to step 4 only (checkpoints 2 and 4;
    the schedule is the same for 4 and 6 steps: the warmup's 20 steps are longer than both),
    and the resumed runs save at their last step only (``checkpoint.every=0``); sub-groups of
    4096 elements (about a hundred per step, leaves spanning many and sharing some) stream
    several times faster than ``nvme_overrides``' 1000.
    """
    nv = tmp_path / "nv"
    nv.mkdir()
    mem = [*FAST, "train.steps=6", "checkpoint.every=2", "zero.gather_dtype=float32"]

    def train(run, *extra):
        cfg = load_config(ROOT / "configs/tiny.yaml", [*mem, *extra])
        return zjax.train("lm", cfg, run_dir=run)

    train(tmp_path / "ref")
    train(tmp_path / "a", *nvme_overrides(nv, 4096), "train.steps=4")
    shutil.copytree(tmp_path / "ref", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "6")
    # NVMe -> memory, memory -> NVMe
    for run, extra in (("a", ()), ("b", nvme_overrides(nv, 4096))):
        ckpts = tmp_path / run / "checkpoints"
        assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["2", "4"]
        _damage(ckpts / "4", ckpts / "2")
        caplog.clear()
        with caplog.at_level("INFO", logger="zjax"):
            train(tmp_path / run, *extra, "checkpoint.every=0")
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
