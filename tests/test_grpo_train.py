"""GRPO through ``zjax.train`` on ``configs/grpo-tiny.yaml`` and the sums of
``examples/grpo_example.py``: the tiny model learns them from the reward alone (with and
without the KL penalty), the rollouts at stage 3 are ``zjax sample``'s greedy tokens on the
exported weights, a broken reward function stops the run by name with its checkpoints
intact, a resumed run trains as one that never stopped, and LoRA trains at every stage."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import rl_user_rewards
from helpers import zjax_main

import zjax
from zjax.config import load_config
from zjax.data import left_padded
from zjax.export import export
from zjax.export.sample import generate, load_sampler, until_stop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import grpo_example  # noqa: E402

CONFIG = ROOT / "configs/grpo-tiny.yaml"
METRICS = ("reward", "reward_std", "rewards/exact_answer", "completions/mean_length",
           "completions/clipped_ratio", "kl", "clip_ratio")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grpo")
    grpo_example.write_tokenizer(out)
    grpo_example.write_prompts(out / "prompts.jsonl", 400)
    return out


def _args(data: Path, *extra: str) -> list[str]:
    return [f"data.path={data / 'prompts.jsonl'}", f"data.tokenizer={data / 'tokenizer.json'}",
            "logging.progress=false", *extra]


def _config(data: Path, *extra: str):
    return load_config(CONFIG, _args(data, *extra))


def _rewards(history: list[dict]) -> list[float]:
    return [row["reward"] for row in history if "reward" in row]


@pytest.mark.slow  # 2 x 20 s: 200 steps each (the README's curve: 0.9 by step 150)
@pytest.mark.long_training
@pytest.mark.parametrize("kl_beta", [0.0, 0.02])
def test_the_tiny_task_is_learned_from_the_reward_alone(data, tmp_path, kl_beta):
    result = zjax.train(None, _config(data, f"rl.kl_beta={kl_beta}", "train.steps=200"),
                        run_dir=tmp_path)
    rewards = _rewards(result.history)
    assert len(rewards) == 20  # every train.log_every = 10 steps, averaged over the 10
    assert rewards[0] < 0.2 and rewards[-1] >= 0.9, rewards
    last = result.history[-1]
    assert all(k in last for k in METRICS), sorted(last)
    assert (last["kl"] > 0) == (kl_beta > 0)
    assert last["clip_ratio"] == 0  # on-policy: the ratio is 1
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").open()]
    assert {s["step"] for s in samples} == {1, *range(10, 201, 10)}
    assert {"prompt", "completion", "reward", "advantage"} <= set(samples[0])


def _prompt_block(sampler, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids and their padding counts."""
    block, lengths = left_padded([np.asarray(sampler.encode(p), np.int32) for p in prompts])
    return block, block.shape[1] - lengths


@pytest.mark.slow  # 25 s: a short run, its export and the sampler
def test_rollouts_at_stage_3_are_zjax_sample_of_the_exported_weights(data, tmp_path):
    """The rollout (gathered once in zero.gather_dtype float32, decoded from the left-padded
    batch) gives, token for token, what ``zjax sample --temperature 0`` gives on the
    float32 export of the same state, prompts of different lengths in one batch."""
    result = zjax.train(None, _config(data, "train.steps=40", "zero.gather_dtype=float32"),
                        run_dir=tmp_path / "run")
    out = tmp_path / "hf"
    export(tmp_path / "run", out, dtype="float32", format="hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / name, out / name)
    sampler = load_sampler(out)
    prompts = [f"{a}+{b}=" for a in range(5) for b in range(5)] + ["7=", "+=", "1+2+3="] * 3
    prompts = prompts[:32]
    block, pads = _prompt_block(sampler, prompts)
    assert len(set(pads.tolist())) == 3
    zstep, state = result.step, result.state
    stop = np.asarray(sorted(sampler.stop), np.int32)
    rows = zstep.rollout(state.params, state.frozen, zstep.put_batch(block),
                         zstep.put_batch(pads), jax.random.key(0), stop, 2, 0.0, 1.0)
    rows = np.asarray(jax.device_get(rows))
    for i, prompt in enumerate(prompts):
        ids = sampler.encode(prompt)
        theirs = generate(sampler.model, np.asarray([ids]), max_new_tokens=2, temperature=0,
                          key=jax.random.key(0), stop=sorted(sampler.stop))[0]
        assert until_stop(rows[i], set(sampler.stop)) == until_stop(theirs, set(sampler.stop))
    # and the CLI's text of the first prompts
    cli = zjax_main("sample", out, "--prompt", prompts[0], "--max-new-tokens", "2",
                    "--temperature", "0")
    assert cli.returncode == 0, cli.stderr
    assert sampler.decode(until_stop(rows[0], set(sampler.stop))) in cli.stdout


@pytest.mark.slow  # 20 s: the run, its resume
def test_a_broken_reward_function_stops_the_run_by_name_and_loses_nothing(data, tmp_path):
    """NaN at the 5th rollout: checkpoints at steps 2 and 4 stay intact, the CLI exits 2
    naming the function with no traceback, and the run resumes from step 4 once fixed."""
    rl_user_rewards.BREAK_AT.update(calls=0, at=5)
    run = tmp_path / "run"
    args = ["train", CONFIG, "--run-dir", run,
            *_args(data, "train.steps=8", "train.log_every=1", "checkpoint.every=2",
                   "rl.rewards=[zjax.rl:exact_answer,rl_user_rewards:breaks_later]")]
    broken = zjax_main(*args)
    assert broken.returncode == 2, broken.stderr
    assert "rl_user_rewards:breaks_later" in broken.stderr
    assert "Traceback" not in broken.stderr + broken.stdout
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 4]
    rl_user_rewards.BREAK_AT.update(calls=0, at=None)  # fixed: the run goes on from step 4
    resumed = zjax_main(*args)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.slow  # 30 s
def test_a_resumed_run_trains_as_one_that_never_stopped(data, tmp_path):
    """Off-policy (two steps per rollout: the pending batch and its old log-probs are saved
    with the checkpoint) with the KL's reference: the sampling RNG, the prompt order and
    the rollouts carry over, bit for bit."""
    common = ["rl.steps_per_generation=2", "rl.kl_beta=0.02", "checkpoint.every=3",
              "train.log_every=1", "data.batch_size=64", "rl.group_size=8"]
    whole = zjax.train(None, _config(data, "train.steps=6", *common), run_dir=tmp_path / "a")
    zjax.train(None, _config(data, "train.steps=3", *common), run_dir=tmp_path / "b")
    resumed = zjax.train(None, _config(data, "train.steps=6", *common), run_dir=tmp_path / "b")
    keys = ("loss", "reward", "kl", "clip_ratio", "completions/mean_length", "grad_norm")
    assert [[r[k] for k in keys] for r in whole.history[3:]] == \
        [[r[k] for k in keys] for r in resumed.history]
    assert any(r["clip_ratio"] > 0 for r in whole.history)  # the second step is off-policy
    for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # 4 x 10 s
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_trains_at_every_stage_against_the_base(data, tmp_path, stage):
    """The reference is the base with the adapters off (no copy): the KL starts at 0 (B is
    zero) and the adapters alone move."""
    result = zjax.train(None, _config(data, f"zero.stage={stage}", "lora.rank=4",
                                      "lora.alpha=8", "rl.kl_beta=0.1", "train.steps=4",
                                      "train.log_every=1", "optimizer.lr=3e-2",
                                      "data.batch_size=64", "rl.group_size=8"),
                        run_dir=tmp_path)
    kls = [row["kl"] for row in result.history]
    assert kls[0] == 0 and kls[-1] > 0, kls
    assert all(np.isfinite(row["loss"]) for row in result.history)
    assert "reference" not in str(jax.tree_util.tree_structure(result.state.frozen))


# GRPO on Llama 3 8B as TRL users run it on one node: 8 prompts x 8 completions per step,
# prompts up to 512 tokens, completions up to 1024, the KL's frozen reference
GRPO_8B = ["rl.method=grpo", "data.format=prompt", "rl.rewards=[zjax.rl:exact_answer]",
           "data.batch_size=64", "data.seq_len=1536", "data.max_prompt_len=512",
           "rl.max_new_tokens=1024", "data.path=", "rl.kl_beta=0.04"]


@pytest.mark.slow  # 20 s: the 8B step and its rollout, compiled for H100
def test_grpo_on_llama3_8b_fits_h100_8_in_training_and_in_rollout():
    """``zjax plan configs/llama3-8b.yaml --target h100:8`` with GRPO: both phases fit, and
    the rollout moves the model once, in bfloat16 (not its float32 master, not per token);
    the reference copy is stored beside the state, never gathered for decoding."""
    rep = zjax.plan(load_config(ROOT / "configs/llama3-8b.yaml", GRPO_8B), target="h100:8")
    r = rep.rollout
    assert rep.fits_device and r["fits_device"], (rep.per_device, r)
    assert r["gathered_bytes"] == pytest.approx(2 * rep.n_params, rel=1e-3)
    assert r["gathered_bytes"] * 0.999 <= r["all_gather_bytes"] <= r["gathered_bytes"]
    assert r["total_bytes"] == r["state_bytes"] + r["temp_bytes"] + r["output_bytes"]
    assert r["temp_bytes"] >= r["gathered_bytes"]  # the gathered copy lives in the program
    assert r["rows"] == 64 and r["new_tokens"] == 1024
    assert "rollout phase (64 completions of 512 + 1024 tokens" in rep.table()
