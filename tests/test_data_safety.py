"""Nothing lost, nothing faked: a stop saves the step it stops at (one process or two), a
non-finite step is never saved, another optimizer is not "damage", flipped bytes and a corrupted
iterator state are, two trainers cannot share a run directory, a refused resume changes
nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import ROOT, children, cli_env, zjax_cmd, zjax_main

import zjax
from zjax.errors import NonFiniteError

pytestmark = pytest.mark.slow  # trains, and stops runs in subprocesses

FAST = ["model.n_layers=2", "data.seq_len=32", "train.eval_every=0", "logging.tensorboard=false",
        "logging.progress=false"]


def _train_cmd(run: Path, *overrides: str) -> list[str]:
    return zjax_cmd("train", "configs/tiny.yaml", *FAST, *overrides, "--run-dir", str(run))


def _train(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``zjax train`` of the tiny GPT to its end, in this process."""
    return zjax_main("train", "configs/tiny.yaml", *FAST, *overrides, "--run-dir", str(run))


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    f = log.open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=f, stderr=subprocess.STDOUT,
                            text=True)


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text()):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{pattern!r} never appeared"
        time.sleep(0.1)


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def _listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 10-step run with checkpoints at 5 and 10."""
    run = tmp_path_factory.mktemp("safety") / "run"
    r = _train(run, "train.steps=10", "train.log_every=5", "checkpoint.every=5",
               "checkpoint.keep=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(run) == [5, 10]
    return run


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def test_sigterm_saves_the_step_it_stops_at_and_a_second_trainer_is_refused(tmp_path):
    # subprocess: the trainer that holds the run directory and is stopped by SIGTERM
    run, log = tmp_path / "run", tmp_path / "log"
    proc = _start(_train_cmd(run, "train.steps=200", "train.log_every=1",
                             "checkpoint.every=1000"), log)
    try:
        _wait_for(log, r"step +3 \|", proc)
        second = _train(run, "train.steps=200")  # the same run directory, from here
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another trainer (pid {proc.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    m = re.search(r"stopped by SIGTERM after step (\d+): checkpoint of step (\d+) saved", text)
    assert m and m.group(1) == m.group(2), text[-2000:]
    stop = int(m.group(1))
    assert _steps(run) == [stop]  # only the stop's own checkpoint: every=1000 saved none
    r = _train(run, f"train.steps={stop + 2}", "train.log_every=1", "checkpoint.every=1000")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from the checkpoint at step {stop}" in r.stdout


def test_two_processes_stop_at_the_same_step_when_one_gets_sigterm(tmp_path):
    # subprocess: `zjax launch`'s two jax.distributed processes, one of them sent SIGTERM
    run, log = tmp_path / "run", tmp_path / "log"
    cmd = zjax_cmd("launch", "-n", "2", "--devices-per-process", "4",
                   "--", *_train_cmd(run, "train.steps=200", "train.log_every=1",
                                     "checkpoint.every=1000"))
    proc = _start(cmd, log)
    _wait_for(log, r"step +3 \|", proc)
    kids = children(proc.pid)
    assert len(kids) == 2
    os.kill(kids[1], signal.SIGTERM)  # one process only: the other learns it from JAX
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    stops = re.findall(r"stopped by SIGTERM after step (\d+): checkpoint of step (\d+) saved",
                       text)
    assert len(stops) == 2 and len(set(stops)) == 1 and stops[0][0] == stops[0][1], text[-3000:]
    assert _steps(run) == [int(stops[0][0])]


def test_nonfinite_steps_are_never_saved_and_finite_checkpoints_survive(base, tmp_path):
    run = _copy(base, tmp_path)
    r = _train(run, "train.steps=30", "train.log_every=5", "checkpoint.every=5",
               "checkpoint.keep=2", "optimizer.lr=1e30")
    assert r.returncode == 1, r.stderr[-3000:]
    assert re.search(r"zjax: error: train.on_nonfinite: stop: step 1[12] is not finite",
                     r.stderr), r.stderr[-2000:]
    assert _steps(run) == [5, 10]  # nothing of lr 1e30 saved, nothing rotated out
    assert r.stderr.count("Traceback") == 0


@pytest.mark.parametrize(("override", "needle"), [
    ("optimizer.name=sgd", "optimizer.name: 'adamw' -> 'sgd'"),
    ("optimizer.clip_norm=null", "optimizer.clip_norm: 1.0 -> None"),
    ("model.d_model=64", "model.d_model: 128 -> 64"),
])
def test_another_optimizer_or_model_is_an_error_and_nothing_moves(base, tmp_path, override,
                                                                   needle):
    run = _copy(base, tmp_path)
    before = _listing(run)
    r = _train(run, "train.steps=20", override)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("zjax:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert _listing(run) == before  # nothing moved, config.yaml and metrics untouched


def _flip_data_bytes(step_dir: Path) -> None:
    """Flip bits inside the array data of every OCDBT data file (the b-tree nodes are the small
    files; which data file holds which arrays varies from run to run)."""
    files = [p for p in (step_dir / "state").rglob("ocdbt.process_*/d/*")
             if p.stat().st_size > 4096]
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        for i in range(1, 8):
            data[len(data) * i // 8] ^= 0x10
        f.write_bytes(bytes(data))


def _swap_in_state_of(step_dir: Path, other: Path) -> None:
    """Replace ``step_dir``'s arrays by ``other``'s: every file reads back cleanly, yet the
    values are not the ones this step recorded (a stale or misplaced copy, silent corruption
    that a codec cannot see)."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(other / "state", step_dir / "state")


# Flipped bits in zstd-compressed OCDBT chunks either fail to decompress (Tensorstore's
# DATA_LOSS / FAILED_PRECONDITION) or decompress to other values (the digest sees them);
# which one depends on where the flips land, which varies with the run's file layout.
_FLIPPED = r"(leaf \S+ reads back other values than were written|it cannot be read)"


def test_flipped_bytes_and_an_altered_iterator_state_are_damage(base, tmp_path):
    run = _copy(base, tmp_path)
    _flip_data_bytes(run / "checkpoints" / "10")
    meta = run / "checkpoints" / "5" / "data" / "metadata"
    state = json.loads(meta.read_text())
    meta.write_text(json.dumps({"train": {"garbage": True}, "eval": state.get("eval")}))
    r = _train(run, "train.steps=12", "train.log_every=1")
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert re.search(r"checkpoint at step 10 .* is damaged \(DamagedCheckpoint: step 10: "
                     + _FLIPPED, log), log[-3000:]
    assert re.search(r"checkpoint at step 5 .* is damaged \(DamagedCheckpoint: step 5: the data "
                     r"iterator's state reads back altered", log), log[-3000:]
    assert "resuming" not in r.stdout  # neither was usable: trained from the start
    assert (run / "damaged-checkpoint-10").is_dir() and (run / "damaged-checkpoint-5").is_dir()
    assert _steps(run) == [12]


def _poisoned(policy: str, **extra) -> zjax.Config:
    overrides = ["loop=tests.user_loop:PoisonedLoop", "data.batch_size=16", "data.seq_len=16",
                 "train.steps=8", "train.log_every=1", "train.eval_every=0",
                 f"train.on_nonfinite={policy}", "zero.param_persistence_threshold=64"]
    return zjax.load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])


def test_python_api_stops_on_a_nan_loss_and_skips_when_asked(tmp_path):
    with pytest.raises(NonFiniteError, match="step 3 is not finite"):
        zjax.train(None, _poisoned("stop", **{"checkpoint.every": 2}), run_dir=tmp_path / "stop")
    assert _steps(tmp_path / "stop") == [2]  # the finite checkpoint stays; nothing of step 3+
    result = zjax.train(None, _poisoned("skip").to_dict())  # a dict is a config too
    assert [r["skipped_steps"] for r in result.history] == [0, 0, 1, 2, 2, 2, 2, 2]
    assert np.isfinite(result.history[-1]["loss"])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.state.params))
    with pytest.raises(NonFiniteError, match=r"train\.max_skips: 2 steps in a row up to step 4"):
        zjax.train(None, _poisoned("skip", **{"train.max_skips": 1}))
    # the skip counts are saved with the checkpoint: a resumed run goes on counting (its own
    # batches 3 and 4, steps 7 and 8, are poisoned again)
    run = tmp_path / "skip"
    zjax.train(None, _poisoned("skip", **{"train.steps": 4, "checkpoint.every": 4}), run_dir=run)
    resumed = zjax.train(None, _poisoned("skip"), run_dir=run)
    assert [r["skipped_steps"] for r in resumed.history] == [2, 2, 3, 4]


def test_ctrl_c_before_training_exits_130_cleanly(tmp_path):
    # subprocess: SIGINT while the process imports (its exit code 130 is os._exit's)
    run, log = tmp_path / "run", tmp_path / "log"
    proc = _start(_train_cmd(run, "train.steps=200"), log)
    time.sleep(1.0)  # importing (compiling starts seconds later on any machine)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "zjax: interrupted" in text and "Traceback" not in text
    assert not (run / "config.yaml").exists()  # written only once training starts


def test_a_finished_run_says_so_before_compiling(base, tmp_path):
    run = _copy(base, tmp_path)
    r = _train(run, "train.steps=10")
    assert r.returncode == 2
    assert "already at step 10; set train.steps above it" in r.stderr
    assert "compiled step" not in r.stdout  # nothing compiled before the answer


def test_export_refuses_altered_values_and_exports_the_intact_checkpoint(base, tmp_path):
    run = _copy(base, tmp_path)
    _swap_in_state_of(run / "checkpoints" / "10", run / "checkpoints" / "5")
    before = _listing(run)
    r = zjax_main("export", str(run), str(tmp_path / "out.safetensors"),
                  "--format", "safetensors", "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert re.search(r"checkpoint at step 10 .*damaged.*checksum mismatch", log), log[-3000:]
    assert "falling back to step 5" in log
    assert _listing(run) == before  # export never changes the run
