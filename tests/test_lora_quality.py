"""LoRA trains as well as a full fine-tune where the base knows the task's pieces.

``examples/lora_example.py`` pretrains the small Llama (300 steps; its bfloat16 export is
``tests/data/lora_base``) on arithmetic chats asked one way, and on chats asked another way
with random answers; the fine-tuning set asks the second way and answers right. Fine-tuned 50
steps each from that base (a Hugging Face Llama): the full model at its rate, rank-8 adapters
at theirs, over a bfloat16 and an nf4 base. Tolerances: the issue's (10%, nf4 15%); measured
eval losses 0.5897 (LoRA, +4.4%), 0.5619 (nf4, -0.5%) and 0.5647 (full), from 0.8601 at the
start. (A base pretrained 150 steps left LoRA 5-7% short: one that still has the task's skill
to learn favours full training.)"""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT

import zjax

sys.path.insert(0, str(ROOT / "examples"))
import lora_example

pytestmark = [pytest.mark.slow, pytest.mark.long_training]


# python examples/lora_example.py OUT --dtype bfloat16, OUT/base copied (300 steps, 0.3 MB): the
# pretraining is the example's, not what this test checks, and took 25 s of it
BASE = ROOT / "tests" / "data" / "lora_base"
STEPS = 50


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_example")
    lora_example.write_data(out)
    return out


def _fine_tune(out, *overrides):
    """``(first step's training loss, last eval loss)`` of configs/lora-llama.yaml."""
    config = zjax.load_config(ROOT / "configs/lora-llama.yaml", [
        f"data.path={out / 'chat.jsonl'}", f"data.tokenizer={BASE / 'tokenizer.json'}",
        f"train.init_from={BASE}", f"train.steps={STEPS}", f"train.eval_every={STEPS}",
        "train.log_every=1", "logging.progress=false", "lora.dropout=0", *overrides])
    history = zjax.train(None, config).history
    return history[0]["loss"], [row["eval_loss"] for row in history if "eval_loss" in row][-1]


def test_lora_and_qlora_come_within_10_and_15_percent_of_the_full_fine_tune(example):
    _, full = _fine_tune(example, "lora.rank=0", "optimizer.lr=3e-3")
    start, lora = _fine_tune(example)
    _, nf4 = _fine_tune(example, "lora.base_dtype=nf4")
    # the adapters learnt the task: most of what the full fine-tune gained over the base
    # (``start``: the base's loss, step 1's), measured 100%
    assert start - lora > 0.8 * (start - full), (start, lora, full)
    assert lora <= 1.10 * full, (lora, full)
    assert nf4 <= 1.15 * full, (nf4, full)
