"""zjax.train end to end: the built-in loop on the stdlib corpus, a user loop, run directory."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from optimized import optimized_cpu_steps

import zjax
from zjax.cli.plot import plot_run
from zjax.config import load_config

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(ROOT / "configs/tiny.yaml",
                      ["train.steps=60", "train.log_every=10", "train.eval_every=60",
                       "train.eval_batches=2", "logging.tensorboard=true"])
    start = time.perf_counter()
    with optimized_cpu_steps():  # 60 steps (tests/optimized.py)
        result = zjax.train("lm", cfg, run_dir=run_dir)
    return result, run_dir, time.perf_counter() - start  # wall time, measured outside


def test_train_tiny_learns_and_evaluates(tiny_run):
    result, _, _ = tiny_run
    history = result.history
    assert [r["step"] for r in history] == [10, 20, 30, 40, 50, 60]
    untrained = math.log(256)
    assert history[-1]["eval_loss"] < untrained - 1.5, history[-1]
    assert history[-1]["loss"] < history[0]["loss"] - 0.8


def test_run_directory_holds_config_metrics_tensorboard(tiny_run):
    result, run_dir, wall_s = tiny_run
    assert load_config(run_dir / "config.yaml").zero.stage == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == result.history
    row = rows[-1]
    for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                "memory_argument_bytes", "memory_temp_bytes", "memory_peak_bytes", "state_bytes"):
        assert key in row and np.isfinite(row[key]), key
    # memory comes from the compiled step, not an estimate: argument bytes = state + batch
    batch_bytes = 16 // 8 * 129 * 4
    assert row["memory_argument_bytes"] == row["state_bytes"] + batch_bytes
    # step times are measured: the six logged intervals of 10 steps fit in the run's wall
    # time (which also holds the compile, the evaluation and the saves) and are not nil
    stepping = sum(10 * r["step_time_s"] for r in rows)
    assert 0 < stepping < wall_s, (stepping, wall_s)
    # tokens/s counts the global batch's tokens (60 steps x 16 x 128 in all), not one device's
    # share: the logged rates, over the logged intervals, account for every token trained
    trained = sum(r["tokens_per_s"] * 10 * r["step_time_s"] for r in rows)
    assert trained == pytest.approx(60 * 16 * 128, rel=1e-6)
    # model FLOPs per second: the plan's FLOPs per token at the measured rate; no MFU on
    # simulated CPU devices (no peak to divide by)
    planned = json.loads((run_dir / "plan.json").read_text())
    assert row["model_flops_per_s"] == pytest.approx(
        row["tokens_per_s"] * planned["flops"]["per_token"])
    assert "mfu" not in row and planned["flops"]["peak_per_device"] is None
    assert any((run_dir / "tensorboard").iterdir())
    # the compiled step's plan report, beside the metrics it explains
    planned = json.loads((run_dir / "plan.json").read_text())
    assert planned["per_device"]["temp_bytes"] == row["memory_temp_bytes"]
    assert planned["per_device"]["host_bytes"] == row["state_host_bytes"]
    assert planned["setting"]["stage"] == 3 and planned["n_devices"] == 8
    # the run directory is never clobbered: another model is refused, a finished run says so
    with pytest.raises(zjax.CheckpointError, match="holds the state of another model or optimizer"):
        zjax.train("lm", load_config(None, ["train.steps=100"]), run_dir=run_dir)
    with pytest.raises(zjax.ConfigError, match="already at step 60"):
        zjax.train("lm", load_config(ROOT / "configs/tiny.yaml", ["train.steps=60"]),
                   run_dir=run_dir)
    assert (run_dir / "checkpoints" / "60").is_dir()
    assert not any(p.name.startswith("damaged") for p in run_dir.iterdir())


def test_plot_writes_valid_pngs(tiny_run, tmp_path):
    _, run_dir, _ = tiny_run
    paths = plot_run(run_dir, tmp_path)
    assert {p.name for p in paths} == {"loss.png", "throughput.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(p)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0


def test_user_loop_from_config_with_its_own_model_section():
    cfg = load_config(None, ["loop=tests.user_loop:CountingLoop", "model.width=32",
                             "data.batch_size=16", "data.seq_len=16", "train.steps=30",
                             "train.log_every=30", "train.eval_every=0",
                             "zero.param_persistence_threshold=64", "optimizer.lr=1e-2"])
    result = zjax.train(None, cfg)
    row = result.history[-1]
    assert row["accuracy"] > 0.5 and row["loss"] < 3.5, row  # untrained: ln 64 = 4.16
    with pytest.raises(zjax.ConfigError, match=r"unknown key 'model.d_model'"):
        load_config(None, ["loop=tests.user_loop:CountingLoop", "model.d_model=8"])
    with pytest.raises(zjax.ConfigError, match="has no 'Nope'"):
        load_config(None, ["loop=tests.user_loop:Nope"])
