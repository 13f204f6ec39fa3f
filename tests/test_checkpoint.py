"""Checkpoints: exact resume after SIGKILL / SIGTERM, restore on other meshes and stages,
damaged-checkpoint fallback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import ROOT, cli_env, latest_checkpoint, start_zjax, zjax_main

import zjax

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

FAST = ["model.n_layers=2", "data.seq_len=32", "train.log_every=5", "train.eval_every=0",
        "logging.tensorboard=false"]


def _cli(*args):
    """``zjax train`` of the tiny GPT in this process: ``(exit code, stdout, stderr)``."""
    r = zjax_main("train", "configs/tiny.yaml", *FAST, *args)
    return r.returncode, r.stdout, r.stderr


def _start(*args):
    """``zjax train`` of the tiny GPT in a process of its own (to be signalled)."""
    return start_zjax("train", "configs/tiny.yaml", *FAST, *args)


def _wait_for_checkpoint(run_dir: Path, step: int, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not (run_dir / "checkpoints" / str(step)).is_dir():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


def _final(run_dir: Path, overrides=()):
    return latest_checkpoint(run_dir, [*FAST, *overrides])


def _assert_bitwise(a, b):
    flat_a, flat_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    rc, _, err = _cli("train.steps=40", "checkpoint.every=5", "--run-dir", str(run))
    assert rc == 0, err[-2000:]
    return (run, *_final(run))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_bit_for_bit(straight, tmp_path, sig):
    # subprocess: the run that is killed (SIGKILL) or preempted (SIGTERM); it resumes here
    run = tmp_path / "run"
    proc = _start("train.steps=40", "checkpoint.every=5", "--run-dir", str(run))
    _wait_for_checkpoint(run, 10, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        # the stop saved the very step it stopped after, and says so
        m = re.search(r"stopped by SIGTERM after step (\d+): checkpoint of step (\d+) saved", err)
        assert m and int(m.group(1)) == int(m.group(2)) == steps[-1], (err[-2000:], steps)
    else:
        assert proc.returncode == -signal.SIGKILL
    assert steps and steps[-1] < 40
    rc, out, err = _cli("train.steps=40", "checkpoint.every=5", "--run-dir", str(run))
    assert rc == 0, err[-2000:]
    assert f"resuming from the checkpoint at step {steps[-1]}" in out
    step, final = _final(run)
    assert step == 40
    _assert_bitwise(final, straight[2])
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8  # steps 5..40, none twice


RESTORE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from zjax.runtime.mesh import simulate_cpu_devices
    simulate_cpu_devices({n})
    import jax, numpy as np, zjax
    from pathlib import Path
    sys.path.insert(0, {root!r} + "/tests")
    from helpers import latest_checkpoint
    assert len(jax.devices()) == {n}
    step, final = latest_checkpoint(Path({run!r}), {fast!r} + {overrides!r})
    expected = np.load({npz!r})
    leaves = jax.tree.leaves(final)
    assert len(leaves) == len(expected.files)
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(leaf, expected[f"a{{i}}"])
    # training continues from the restored state on this mesh
    cfg = zjax.load_config({root!r} + "/configs/tiny.yaml", {fast!r} + {overrides!r}
                           + ["train.steps=" + str(step + 2), "train.log_every=1"])
    result = zjax.train("lm", cfg, run_dir={run!r})
    assert [r["step"] for r in result.history] == [step + 1, step + 2]
    print("restored", step, "on", len(jax.devices()), "devices")
""")


@pytest.mark.parametrize(("devices", "overrides"), [
    (4, ["mesh.data=4"]), (1, ["mesh.data=1"]), (8, ["zero.stage=1"]),
])
def test_restore_on_other_device_counts_and_stages(straight, tmp_path, devices, overrides):
    import shutil

    straight_dir, step, final = straight
    src = tmp_path / "run"
    shutil.copytree(straight_dir, src)  # continuing training must not touch the fixture's run
    if devices == 8:  # this process's devices: RESTORE's checks, here
        assert len(jax.devices()) == devices
        restored, got = latest_checkpoint(src, [*FAST, *overrides])
        leaves, expected = jax.tree.leaves(got), jax.tree.leaves(final)
        assert len(leaves) == len(expected)
        for leaf, want in zip(leaves, expected, strict=True):
            np.testing.assert_array_equal(leaf, want)
        # training continues from the restored state on this mesh
        cfg = zjax.load_config(ROOT / "configs/tiny.yaml", [
            *FAST, *overrides, f"train.steps={restored + 2}", "train.log_every=1"])
        result = zjax.train("lm", cfg, run_dir=src)
        assert [r["step"] for r in result.history] == [restored + 1, restored + 2]
        assert restored == step
        return
    # subprocess: another device count than this process's 8
    npz = tmp_path / "expected.npz"
    np.savez(npz, **{f"a{i}": x for i, x in enumerate(jax.tree.leaves(final))})
    script = RESTORE.format(root=str(ROOT), n=devices, run=str(src), overrides=overrides,
                            npz=str(npz), fast=FAST)
    r = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"restored {step} on {devices} devices" in r.stdout


def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path):
    run = tmp_path / "run"
    rc, _, err = _cli("train.steps=10", "checkpoint.every=5", "--run-dir", str(run))
    assert rc == 0, err[-2000:]
    latest = run / "checkpoints" / "10"
    victims = [p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 64]
    for p in victims:  # truncate the array data of the latest checkpoint
        p.write_bytes(p.read_bytes()[:16])
    rc, out, err = _cli("train.steps=12", "checkpoint.every=5", "--run-dir", str(run))
    assert rc == 0, err[-3000:]
    log = out + err
    assert "checkpoint at step 10" in log and "damaged" in log
    assert "resuming from the checkpoint at step 5" in out
    assert (run / "damaged-checkpoint-10").is_dir()  # moved aside, not deleted
    assert (run / "checkpoints" / "12").is_dir()
