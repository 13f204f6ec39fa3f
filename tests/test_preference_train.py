"""Preference tuning through ``zjax.train`` on ``configs/dpo-llama.yaml`` and the pairs of
``examples/dpo_example.py`` (sorted digits chosen, unsorted rejected): the precomputed
reference is written to the run directory and read back on resume, a resumed run trains the
same losses as one that never stopped, the eval split reports TRL's metric names, and the
tiny model learns the rule (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import zjax
from zjax.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import dpo_example  # noqa: E402

CONFIG = ROOT / "configs/dpo-llama.yaml"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return dpo_example.write_pairs(tmp_path_factory.mktemp("dpo") / "pairs.jsonl", 600)


def _config(pairs: Path, *extra: str):
    return load_config(CONFIG, [f"data.path={pairs}", "data.batch_size=16",
                                "model.d_model=32", "model.d_ff=64", "train.log_every=1",
                                "logging.progress=false", *extra])


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["precompute", "model"])
def test_a_resumed_run_trains_as_one_that_never_stopped(pairs, tmp_path, reference):
    """``precompute``: the values are read back, not computed again; ``model``: the frozen
    copy is made again from the starting weights alone."""
    common = [f"preference.reference={reference}", "checkpoint.every=2",
              "train.eval_every=4", "data.eval_fraction=0.1"]
    whole = zjax.train("llama", _config(pairs, "train.steps=4", *common),
                       run_dir=tmp_path / "whole")
    losses = [r["loss"] for r in whole.history if "loss" in r]
    assert losses[0] == pytest.approx(0.6931, abs=1e-4)  # ln 2: the reference is the start
    assert (tmp_path / "whole" / "reference_logps.npz").is_file() == (reference == "precompute")
    cut = tmp_path / "cut"
    zjax.train("llama", _config(pairs, "train.steps=2", *common), run_dir=cut)
    resumed = zjax.train("llama", _config(pairs, "train.steps=4", *common), run_dir=cut)
    again = [r["loss"] for r in resumed.history if "loss" in r]
    assert again == losses[2:]  # bit for bit, the reference read back, not recomputed
    last = _rows(cut)[-1]
    # the eval split's reference is precomputed too (not the policy itself: margins 0, ln 2)
    assert abs(last["eval_loss"] - 0.6931471805599453) > 1e-4
    assert last["eval_rewards/accuracies"] > 0.5
    for key in ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins",
                "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert key in last, key


def test_a_text_format_with_a_preference_method_is_refused(pairs):
    with pytest.raises(zjax.ConfigError, match=r"data\.format"):
        zjax.train("llama", _config(pairs, "data.format=text", "train.steps=1"))
    # and pairs without a method would train next-token prediction on the rejected answers
    with pytest.raises(zjax.ConfigError, match=r"preference\.method"):
        zjax.train("llama", _config(pairs, "preference.method=null", "train.steps=1"))


def _chat_pairs(path: Path, n: int) -> Path:
    """Conversational pairs: an explicit prompt (lists of messages), and whole conversations
    whose shared first turns are the prompt (TRL's implicit prompt)."""
    rows = []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        ask = [{"role": "user", "content": f"Compute {a} plus {b}."}]
        say = lambda v: [{"role": "assistant", "content": f"That makes {v}."}]
        if i % 2:
            rows.append({"prompt": ask, "chosen": say(a + b), "rejected": say(a + b + 1)})
        else:
            rows.append({"chosen": ask + say(a + b), "rejected": ask + say(a - b - 1)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_an_imported_hf_model_tunes_on_chat_pairs_and_exports_as_itself(tmp_path):
    """DPO from a Hugging Face directory (the reference a copy of its weights) on pairs
    rendered with its chat template; the export is the plain model, no reference in it."""
    from safetensors import safe_open

    from zjax.export import export

    base = ROOT / "tests" / "data" / "lora_base"
    pairs = _chat_pairs(tmp_path / "chat_pairs.jsonl", 64)
    config = load_config(ROOT / "configs/lora-llama.yaml", [
        "lora.rank=0", "lora.dropout=0", f"train.init_from={base}", f"data.path={pairs}",
        f"data.tokenizer={base / 'tokenizer.json'}", "data.format=preference",
        "data.seq_len=48", "preference.method=dpo", "train.steps=3", "train.eval_every=0",
        "checkpoint.every=3", "train.log_every=1", "logging.progress=false"])
    result = zjax.train("llama", config, run_dir=tmp_path / "run")
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert losses[0] == pytest.approx(0.6931, abs=1e-4)
    out = export(tmp_path / "run", tmp_path / "hf", format="hf")
    with safe_open(str(out / "model.safetensors"), "np") as f:
        names = set(f.keys())
    with safe_open(str(base / "model.safetensors"), "np") as f:
        assert names == set(f.keys())


@pytest.mark.slow
@pytest.mark.long_training
def test_dpo_learns_the_rule_the_rejected_answers_break(tmp_path):
    """The README's example at full size: eval rewards/accuracies >= 0.95 on pairs the
    model never saw."""
    data = dpo_example.write_pairs(tmp_path / "pairs.jsonl", 4000)
    result = zjax.train("llama", load_config(CONFIG, [f"data.path={data}",
                                                      "logging.progress=false"]))
    evals = [r for r in result.history if "eval_rewards/accuracies" in r]
    assert evals[-1]["eval_rewards/accuracies"] >= 0.95, evals
