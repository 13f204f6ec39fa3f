"""kill -9 mid-epoch and resume, on a Parquet text source and on a chat JSONL source: the
resumed run's final state is bitwise the straight run's (the packed windows' order is an index
that grain's iterator state restores), and its metrics rows carry ``loss_tokens``."""

from __future__ import annotations

import json
import signal
import time

import jax
import numpy as np
import pytest
from helpers import latest_checkpoint, start_zjax, zjax_main
from sft_data import chat_dir, write_sources

pytestmark = pytest.mark.slow  # trains three runs per source

CONFIG = "configs/sft-llama.yaml"
FAST = ["train.init_from=null", "data.seq_len=48", "data.batch_size=8", "train.steps=20",
        "checkpoint.every=4", "train.log_every=4", "train.eval_every=0",
        "logging.tensorboard=false", "model.n_layers=1"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    tokenizer, rows = chat_dir(root / "tok", n=240)
    chat = write_sources(root / "chat", rows)["jsonl"]
    texts = [{"text": " ".join(m["content"] for m in r["messages"])} for r in rows]
    parquet = write_sources(root / "text", texts)["parquet"]
    return {"parquet": [f"data.path={parquet}", "data.format=text"],
            "chat": [f"data.path={chat}", "data.format=chat"]}, tokenizer


def _run(args, run_dir, wait=True):
    """``zjax train`` to its end in this process (its stdout), or (``wait=False``) started in
    a process of its own, to be killed."""
    if not wait:
        return start_zjax("train", CONFIG, *FAST, *args, "--run-dir", str(run_dir))
    r = zjax_main("train", CONFIG, *FAST, *args, "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("kind", ["parquet", "chat"])
def test_kill_9_and_resume_is_bitwise_the_straight_run(sources, tmp_path, kind):
    overrides, tokenizer = sources
    args = [*overrides[kind], f"data.tokenizer={tokenizer}"]
    _run(args, tmp_path / "straight")
    # subprocess: the run killed with SIGKILL mid-epoch (the straight and resumed runs: here)
    proc = _run(args, tmp_path / "killed", wait=False)
    deadline = time.monotonic() + 300
    while not (tmp_path / "killed" / "checkpoints" / "8").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    out = _run(args, tmp_path / "killed")
    assert "resuming from the checkpoint at step" in out
    both = [latest_checkpoint(tmp_path / name, [*FAST, *args], config=CONFIG)
            for name in ("straight", "killed")]
    assert both[0][0] == both[1][0] == 20
    for a, b in zip(jax.tree.leaves(both[0][1]), jax.tree.leaves(both[1][1]), strict=True):
        np.testing.assert_array_equal(a, b)
    rows = [json.loads(line) for line in
            (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in
                (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 12, 16, 20]
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]
    assert all(r["loss_tokens"] > 0 for r in rows)
    if kind == "chat":  # the completion-only loss trains on fewer tokens than the windows hold
        assert all(r["loss_tokens"] < 8 * 48 * 0.6 for r in rows)
