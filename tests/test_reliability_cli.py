"""The post-training paths through the CLI (issue 67, items 15-17).

- 15: a DeepSeek-V2 ``config.json`` with ``"n_shared_experts": null`` imports as a model with no
  shared experts (transformers' ``DeepseekV2MoE`` and DeepSeek's own code build them only where
  the key is not None), giving the logits of the same model whose shared experts add nothing.
- 16: a command whose stdout is its result (``zjax sample``, ``zjax export``) writes its log
  lines to stderr: stdout holds the generated text, the exported path, and nothing else.
- 17: ``train.steps=1 optimizer.warmup_steps=0`` trains its one step at ``optimizer.lr`` (it
  raised optax's "decay_steps=0"); warmup 0 is no warmup (the first step at ``lr``, as Hugging
  Face's schedules); a warmup as long as the run or longer is cut by its end, said in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import zjax_main
from test_reliability_hf import _llama_dir, _wordlevel

from zjax.config import OptimizerConfig
from zjax.step.optim import make_schedule

TINY_RUN = ["configs/tiny.yaml", "data.path=", "model.n_layers=1", "model.d_model=32",
            "model.n_heads=2", "model.d_ff=64", "data.seq_len=16", "data.batch_size=8",
            "train.eval_every=0", "train.log_every=1", "logging.progress=false",
            "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """``zjax train`` of one step, no warmup, into a run directory (its CLI result)."""
    run = tmp_path_factory.mktemp("one_step") / "run"
    r = zjax_main("train", *TINY_RUN, "train.steps=1", "optimizer.warmup_steps=0",
                  "--run-dir", run)
    return run, r


# ---- 17: a one-step run, and the schedule's edges ---------------------------------------------

def test_one_step_without_warmup_trains_at_the_full_rate(one_step_run):
    run, r = one_step_run
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["lr"] == pytest.approx(3e-3)  # configs/tiny.yaml's optimizer.lr
    assert "warmup" not in r.stdout  # nothing to say


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize(("warmup", "steps"), [(0, 1), (0, 2), (1, 1), (3, 3), (5, 2), (2, 6)])
def test_the_schedule_warms_up_as_hugging_face_and_never_decays_over_0_steps(schedule, warmup,
                                                                            steps):
    """Step ``s < warmup`` at ``lr * s / warmup``, then ``lr`` (constant) or a cosine from
    ``lr`` towards lr/10 at ``steps``: no warmup, one of the run's length or longer included."""
    lr = 0.5
    sched = make_schedule(OptimizerConfig(lr=lr, warmup_steps=warmup, schedule=schedule),
                          total_steps=steps)
    got = np.array([float(sched(s)) for s in range(steps + 1)])
    want = np.array([lr * s / warmup if s < warmup else lr for s in range(steps + 1)])
    if schedule == "cosine":  # after the warmup: lr at its first step, lr/10 at `steps`
        span = max(1, steps - warmup)
        after = [lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(s - warmup, span) / span)))
                 for s in range(steps + 1)]
        want = np.where(np.arange(steps + 1) < warmup, want, after)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[0] == (lr if warmup == 0 else 0.0)


def test_a_warmup_longer_than_the_run_trains_and_says_so(tmp_path):
    r = zjax_main("train", *TINY_RUN, "train.steps=2", "optimizer.warmup_steps=4",
                  "--run-dir", tmp_path / "run")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ("optimizer.warmup_steps 4 >= train.steps 2: the warmup is cut by the run's end "
            "(the last step's rate 0.00075, not optimizer.lr 0.003)") in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [row["lr"] for row in rows] == pytest.approx([0.0, 0.00075])


# ---- 16: logs on stderr, the result alone on stdout -------------------------------------------

def test_sample_prints_only_the_text_and_logs_to_stderr(tmp_path):
    directory = _llama_dir(tmp_path / "hf")
    hf = json.loads((directory / "config.json").read_text())
    del hf["rope_theta"]  # read at its default, which the import logs
    (directory / "config.json").write_text(json.dumps(hf))
    _wordlevel(directory / "tokenizer.json")
    r = zjax_main("sample", directory, "--prompt", "w1 w2", "--max-new-tokens", "3",
                  "--temperature", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "leaves out rope_theta (default 10000.0)" in r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("w1 w2"), r.stdout


def test_export_prints_only_the_path_and_logs_to_stderr(one_step_run, tmp_path):
    run, _ = one_step_run
    out = tmp_path / "params.safetensors"
    r = zjax_main("export", run, out, "--format", "safetensors")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == f"{out}\n" and out.is_file()  # OUT=$(zjax export ...) works
    assert "exporting" in r.stderr and "params leaves of step 1" in r.stderr


# ---- 15: DeepSeek-V2's "n_shared_experts": null ------------------------------------------------

def test_deepseek_v2_with_null_shared_experts_imports_as_none(tmp_path):
    """transformers' ``DeepseekV2Config`` keeps the null; its ``DeepseekV2MoE`` then builds no
    ``shared_experts``. The reference: the same weights with shared experts whose
    ``down_proj`` is 0 (they add nothing), from the same routed experts."""
    from hf_deepseek import deepseek_logits, deepseek_tensors, deepseek_v2_config
    from hf_reference import write_checkpoint
    from test_hf_deepseek import TOKENS, _zjax_logits

    from zjax.config import load_config

    shared = deepseek_v2_config()
    tensors = deepseek_tensors(shared)
    for name in tensors:
        if ".shared_experts.down_proj." in name:
            tensors[name] = np.zeros_like(tensors[name])
    want = deepseek_logits(shared, tensors, TOKENS)
    hf = deepseek_v2_config(n_shared_experts=None)
    assert hf["n_shared_experts"] is None  # as transformers writes it
    directory = write_checkpoint(tmp_path / "hf", hf, {
        k: v for k, v in tensors.items() if ".shared_experts." not in k})
    r = zjax_main("import-hf", directory, tmp_path / "imported")
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_config(tmp_path / "imported" / "zjax.yaml").model.n_shared_experts == 0
    np.testing.assert_allclose(_zjax_logits(directory), want, atol=2e-4, rtol=0)
