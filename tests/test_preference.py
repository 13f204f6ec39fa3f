"""Preference tuning in the step: DPO's first loss is ln 2 whichever reference (a frozen copy,
precomputed log-probs, the base with adapters off), IPO's is (1 / (2 beta))^2, the copy and
the precomputed values train the same, and ZeRO-3 on 8 devices equals one device.

Batches are built by hand here (rows 2i chosen, 2i + 1 rejected, a shared prompt, the loss
mask on the answers); ``tests/test_preference_data.py`` covers the data format.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import zjax
from zjax.config import Config, OptimizerConfig, TrainConfig
from zjax.data import DataConfig
from zjax.lora import LoraConfig
from zjax.models import LlamaConfig
from zjax.partition import nbytes
from zjax.preference import REFERENCE, PreferenceConfig

TINY = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                   max_seq_len=32)
SEQ = 16


def pair_batch(rows: int, *, seed: int = 0, ref: bool = False) -> dict:
    """``rows`` rows of ``rows / 2`` pairs: a shared prompt, two answers, padding after."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((rows, SEQ + 1), np.int32)
           for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    for i in range(0, rows, 2):
        prompt = rng.integers(1, 64, rng.integers(2, 6))
        for j in (i, i + 1):
            answer = rng.integers(1, 64, rng.integers(2, SEQ + 1 - len(prompt)))
            n = len(prompt) + len(answer)
            out["tokens"][j, :n] = np.concatenate([prompt, answer])
            out["segment_ids"][j, :n] = 1
            out["positions"][j, :n] = np.arange(n)
            out["loss_mask"][j, len(prompt):n] = 1
    if ref:
        out["ref_logps"] = np.zeros(rows, np.float32)
    return out


def make(method="dpo", reference=None, *, data=8, stage=3, gather="bfloat16", rows=16,
         micro=1, lora=0, context=1, **pref):
    config = Config(
        loop="llama", model=TINY, mesh=zjax.MeshConfig(data=data, context=context),
        zero=zjax.ZeroConfig(stage=stage, param_persistence_threshold=0, gather_dtype=gather,
                             reduce_dtype="float32"),
        data=DataConfig(batch_size=rows, seq_len=SEQ, format="preference"),
        train=TrainConfig(grad_accum=micro, eval_every=0),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
        lora=LoraConfig(rank=lora, alpha=2.0 * lora) if lora else LoraConfig(),
        preference=PreferenceConfig(method=method, reference=reference, **pref))
    return zjax.build_step(config, devices=jax.devices()[:data * context])


def run(zstep, batches, *, precompute: bool = False) -> tuple[list[dict], object]:
    """Steps from seed 0 over ``batches``; with ``precompute`` the reference's log-probs are
    scored by the starting weights first (as the trainer does) and carried in the batch."""
    state = zstep.init(jax.random.key(0))
    if precompute:
        batches = [dict(b, ref_logps=np.asarray(zstep.score(state.params, zstep.put_batch(b),
                                                            state.frozen)))
                   for b in batches]
    out = []
    for b in batches:
        state, m = zstep.step(state, zstep.put_batch(b))
        out.append({k: float(v) for k, v in m.items()})
    return out, state


BATCHES = [pair_batch(16, seed=s) for s in range(3)]


def test_the_loss_pairs_even_rows_with_the_next_and_skips_empty_pairs():
    """``preference_loss`` on a plain model: pair i is rows 2i (chosen) and 2i + 1, only
    answer tokens count, a pair with no answer token (eval padding) counts for nothing."""
    from flax import nnx

    from zjax.models import Llama, sequence_logps
    from zjax.preference import preference_loss

    model = Llama(TINY, rngs=nnx.Rngs(0))
    batch = pair_batch(8, seed=7)
    for k in batch:  # the last pair is padding
        batch[k][6:] = 0
    logps, counts, _ = sequence_logps(model, batch)
    logps = np.asarray(logps, np.float64)
    ref = logps + np.random.default_rng(1).normal(0, 1, 8)
    cfg = PreferenceConfig(method="dpo", beta=0.3)
    loss, count, sums = preference_loss(model, dict(batch, ref_logps=ref), config=cfg,
                                        reference=None)
    z = 0.3 * ((logps[0:6:2] - ref[0:6:2]) - (logps[1:6:2] - ref[1:6:2]))
    assert float(count) == 3 and np.asarray(counts)[6:].sum() == 0
    assert float(loss) == pytest.approx(np.sum(np.logaddexp(0, -z)), rel=1e-5)
    assert float(sums["logps/chosen"]) == pytest.approx(logps[0:6:2].sum(), rel=1e-5)
    assert float(sums["logps/rejected"]) == pytest.approx(logps[1:6:2].sum(), rel=1e-5)


# the quick loop's three DPO steps, shared: one device (stage 0), and 8 devices at stage 3
# with 2 micro-batches, the reference a frozen copy or precomputed (float32 gathers: the
# comparison with one device is exact to float32 rounding)
ZERO3 = dict(data=8, stage=3, gather="float32", rows=32, micro=2)
BATCHES_32 = [pair_batch(32, seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def dpo_runs():
    one, _ = run(make("dpo", data=1, stage=0, gather="float32", rows=32), BATCHES_32)
    copied, state = run(make("dpo", **ZERO3), BATCHES_32)
    precomputed, _ = run(make("dpo", "precompute", **ZERO3), BATCHES_32, precompute=True)
    return one, copied, state, precomputed


def test_dpo_starts_at_ln2_with_a_frozen_copy_and_with_precomputed_logps(dpo_runs):
    _, copied, state, precomputed = dpo_runs
    assert copied[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert copied[0]["rewards/accuracies"] == 0.0  # no reward differs yet
    assert copied[-1]["loss"] < copied[0]["loss"]
    # the copy: frozen, in the gather dtype, sharded like the policy, never trained
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {np.dtype("float32")}
    assert REFERENCE not in state.params
    n = sum(x.size for x in jax.tree.leaves(state.params))
    assert nbytes(state.frozen) == pytest.approx(4 * n / 8, rel=0.01)  # per device
    assert precomputed[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    for a, b in zip(copied, precomputed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=1e-4)


def test_ipo_starts_at_its_target_margin_squared():
    metrics, _ = run(make("ipo", "precompute", data=1, beta=0.25), BATCHES[:1],
                     precompute=True)
    assert metrics[0]["loss"] == pytest.approx((1 / (2 * 0.25)) ** 2, rel=1e-5)


def test_lora_reference_is_the_base_with_adapters_off():
    zstep = make(lora=4, data=8)
    assert REFERENCE not in zstep.abstract_state.frozen  # no second copy
    metrics, _ = run(zstep, BATCHES)  # (the schedule's first step has lr 0)
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def _same_steps(one, eight):
    for a, b in zip(one, eight, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/accuracies", "logps/rejected"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_zero3_dpo_on_8_devices_equals_one_device(dpo_runs):
    one, copied, _, _ = dpo_runs
    _same_steps(one, copied)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "data", "context", "micro"), [
    ("orpo", 8, 1, 2),
    ("ipo", 4, 2, 1),  # each sequence striped over a context axis of 2
])
def test_zero3_on_8_devices_equals_one_device(method, data, context, micro):
    one, _ = run(make(method, data=1, stage=0, gather="float32", rows=32), BATCHES_32)
    eight, _ = run(make(method, data=data, context=context, stage=3, gather="float32",
                        rows=32, micro=micro), BATCHES_32)
    _same_steps(one, eight)


def test_a_pair_split_across_micro_batches_is_refused():
    with pytest.raises(zjax.ConfigError, match=r"data\.batch_size"):
        run(make(rows=16, micro=2), BATCHES[:1])


# llama3-8b itself for h100:8 (the README's figures); a narrow 2-layer Llama for v5p, whose
# compiler takes 40 s a plan of the 8B here (and 60 s the two plans of a 4-layer d_model 1024)
SHAPES = {"h100:8": [], "v5p:2x2x2": ["model.d_model=512", "model.n_heads=8",
                                      "model.n_kv_heads=2", "model.d_ff=1792",
                                      "model.vocab_size=8192", "model.n_layers=2",
                                      # every leaf sharded, as at the 8B's sizes
                                      "zero.param_persistence_threshold=0"]}


@pytest.mark.slow
@pytest.mark.parametrize("tgt", list(SHAPES))
def test_the_reference_of_llama3_8b_adds_its_bf16_shards_and_nothing_else(tgt):
    """``zjax plan configs/llama3-8b.yaml preference.method=dpo --target h100:8``: the frozen
    copy adds its bfloat16 shards (2 bytes x 8.03e9 / 8 devices) to the step and no temp (its
    forward runs before the policy's, outside the backward); precomputed, it adds nothing.
    (XLA:CPU's figures are not a GPU's or TPU's: its schedule does not minimise memory.)"""
    small = ["data.batch_size=16", "data.seq_len=256", "data.path=", *SHAPES[tgt]]
    plan = lambda *extra: zjax.plan(zjax.load_config("configs/llama3-8b.yaml",
                                                      [*small, *extra]), target=tgt)
    plain, dpo = plan(), plan("preference.method=dpo")
    shards = 2 * plain.n_params / 8
    assert dpo.per_device["params_bytes"] - plain.per_device["params_bytes"] == \
        pytest.approx(shards, rel=1e-3)
    assert dpo.per_device["total_bytes"] - plain.per_device["total_bytes"] <= shards * 1.001
    assert dpo.frozen["frozen_kind"] == "reference"
    assert dpo.frozen["frozen_dtypes"] == ["bfloat16"]  # zero.gather_dtype's
    # model FLOPs count the reference's forward: a third of training's 6N (and attention)
    assert dpo.flops["per_token"] == pytest.approx(plain.flops["per_token"] * 4 / 3)
    if tgt == "h100:8":
        precomputed = plan("preference.method=dpo", "preference.reference=precompute")
        assert precomputed.per_device["params_bytes"] == plain.per_device["params_bytes"]
