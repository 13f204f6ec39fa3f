"""The mixture-of-experts layer (``zjax.nn.moe``) and the reference Llama's experts option.

- The layer equals a plain reference that runs every expert on every token and masks
  (values and gradients, ``helpers.FP32``), dropless and with a capacity, which drops the
  assignments GShard's rule (a queue per expert, first choices first) drops.
- Its load-balance statistic is Hugging Face's ``load_balancing_loss_func`` (written again in
  numpy, with an attention mask), its z-loss ST-MoE's.
- Training a Llama with experts (shared ones, both router losses, packed documents with
  padding) equals single-device optax at stage 3 and with tensor parallelism; a capacity's
  dropped assignments are counted per step (``moe_dropped_tokens``) over each device's tokens.
- Bad settings are refused naming the key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FP32,
    assert_matches_reference,
    assert_trees_close,
    make_tx,
    reference_run,
    train_steps,
)
from models import TINY_LLAMA, llama_reference_loss, llama_trainable, token_batches

import zjax
from zjax.models import LlamaConfig
from zjax.nn.moe import Experts, capacity, moe_ffn, route

E, K, N, D, F = 4, 2, 40, 16, 24


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (N, D), jnp.float32)
    router = jax.random.normal(keys[1], (D, E), jnp.float32)
    w = Experts(*(0.3 * jax.random.normal(kk, s, jnp.float32) for kk, s in
                  zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)))
    return x, router, w


def _queue_kept(top: np.ndarray, cap: int) -> np.ndarray:
    """GShard's rule as a queue per expert: all first choices, then all second ones, each in
    token order; an expert takes the first ``cap`` that reach it."""
    kept = np.zeros(top.shape, bool)
    filled = np.zeros(E, int)
    for j in range(top.shape[1]):
        for t in range(top.shape[0]):
            e = top[t, j]
            if filled[e] < cap:
                kept[t, j], filled[e] = True, filled[e] + 1
    return kept


def _reference(x, router, w, *, k, renormalize, kept=None):
    """Every expert on every token, masked to the tokens that chose it."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    top = jnp.argsort(-probs, axis=-1)[:, :k]
    weights = jnp.take_along_axis(probs, top, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    if kept is not None:
        weights = weights * kept
    y = jnp.zeros_like(x)
    for e in range(E):
        mask = jnp.sum(jnp.where(top == e, weights, 0.0), axis=-1)
        h = jax.nn.silu(x @ w.gate[e]) * (x @ w.up[e])
        y = y + mask[:, None] * (h @ w.down[e])
    return y, np.asarray(top)


def _check(factor, renormalize):
    x, router, w = _inputs()
    kept = None
    if factor is not None:
        top = _reference(x, router, w, k=K, renormalize=renormalize)[1]
        kept = _queue_kept(top, capacity(N, K, E, factor))
        assert 0 < (~kept).sum() < kept.size // 2  # some dropped, most kept
    # a random cotangent and the sum of its product: values and every gradient compared
    ct = jax.random.normal(jax.random.key(9), (N, D), jnp.float32)
    got_fn = lambda *a: jnp.sum(ct * moe_ffn(a[0], a[1], Experts(*a[2:]), k=K,
                                              renormalize=renormalize,
                                              capacity_factor=factor)[0])
    want_fn = lambda *a: jnp.sum(ct * _reference(a[0], a[1], Experts(*a[2:]), k=K,
                                                 renormalize=renormalize, kept=kept)[0])
    args = (x, router, *w)
    got, want = jax.value_and_grad(got_fn, argnums=range(5))(*args), \
        jax.value_and_grad(want_fn, argnums=range(5))(*args)
    assert abs(float(want[0])) > 1.0
    assert_trees_close(got, want, **FP32, what="value and grads")
    return kept


@pytest.mark.parametrize("renormalize", [True, False])
def test_dropless_equals_the_masked_reference(renormalize):
    _check(None, renormalize)


def test_capacity_drops_what_the_queue_rule_drops():
    kept = _check(0.75, True)
    x, router, w = _inputs()
    _, stats = moe_ffn(x, router, w, k=K, capacity_factor=0.75)
    assert float(stats.dropped) == (~kept).sum()


def test_balance_and_z_losses_are_huggingfaces():
    x, router, w = _inputs(1)
    mask = (np.arange(N) % 7 != 3).astype(np.float32)  # some padding
    _, stats = moe_ffn(x, router, w, k=K, mask=jnp.asarray(mask))
    # transformers' load_balancing_loss_func (4.57) for one layer, with an attention mask
    logits = np.asarray(x @ router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :K]
    onehot = np.eye(E)[top]  # [N, K, E]
    per_expert = (onehot * mask[:, None, None]).sum(0) / mask.sum()
    prob_per_expert = (probs * mask[:, None]).sum(0) / mask.sum()
    want = E * np.sum(per_expert * prob_per_expert[None])
    np.testing.assert_allclose(float(stats.balance), want, rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(stats.z), np.sum(mask * lse ** 2) / mask.sum(), rtol=1e-5)
    routing = route(jnp.asarray(logits, jnp.float32), k=K)
    np.testing.assert_array_equal(np.asarray(routing.experts), top)


MOE = dataclasses.replace(TINY_LLAMA, n_experts=4, experts_per_token=2, n_shared_experts=1,
                          moe_d_ff=16, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)


def _packed(batches):
    out = []
    for b in batches:
        seg = np.ones_like(b)
        seg[:, 7:] = 2
        seg[::2, -3:] = 0  # padding: the router's statistics leave it out
        out.append({"tokens": b, "segment_ids": seg})
    return out


@pytest.fixture(scope="module")
def reference():
    batches = _packed(token_batches(4))
    loss = llama_reference_loss(MOE)
    return batches, reference_run(llama_trainable(MOE).init, lambda p, b: loss(p, b)[:2],
                                  make_tx(), batches)


@pytest.mark.parametrize(("stage", "data", "model"), [
    pytest.param(3, 8, 1), pytest.param(3, 4, 2),
    pytest.param(2, 8, 1, marks=pytest.mark.slow), pytest.param(0, 8, 1, marks=pytest.mark.slow),
])
def test_training_matches_single_device(reference, stage, data, model):
    batches, expected = reference
    zero = zjax.ZeroConfig(stage=stage, prefetch_layers=1, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")
    mesh = zjax.make_mesh(zjax.MeshConfig(data=data, model=model))
    zstep, state, losses = train_steps(llama_trainable(MOE), zero, batches, mesh=mesh)
    assert_matches_reference(losses, state, expected)
    leaf = zstep.plan.leaves_by_path["blocks/layers/w_gate"]
    assert leaf.shape == (3, 4, 32, 16)
    if model > 1:  # each expert's hidden units split over model
        assert leaf.model_dim == 3


def test_capacity_counts_each_devices_dropped_assignments():
    cfg = dataclasses.replace(MOE, n_shared_experts=0, capacity_factor=0.5)
    batch = token_batches(1)[0]
    zero = zjax.ZeroConfig(stage=3, param_persistence_threshold=0)
    zstep, state, _ = train_steps(llama_trainable(cfg), zero, [])
    params = jax.device_get(state.params)  # the step donates the state
    _, metrics = zstep.step(state, zstep.put_batch(batch))
    # the same params on one device, each device's 2 rows a group of its own
    from flax import nnx

    from zjax.models import Llama, lm_loss
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, params)
    want = sum(float(lm_loss(model, jnp.asarray(batch[i:i + 2]))[2]["moe_dropped_tokens"])
               for i in range(0, 16, 2))
    assert want > 0
    assert float(metrics["moe_dropped_tokens"]) == want


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(n_experts=4, experts_per_token=5),
     r"^model\.experts_per_token: 5 exceeds model\.n_experts 4"),
    (dict(n_shared_experts=1), r"^model\.n_shared_experts: 1 needs model\.n_experts"),
    (dict(n_experts=4, mlp_chunk=64), r"^model\.mlp_chunk: 64 tiles a dense MLP"),
    (dict(n_experts=4, capacity_factor=0), r"^model\.capacity_factor"),
])
def test_bad_expert_settings_name_the_key(overrides, message):
    with pytest.raises(zjax.ConfigError, match=message):
        LlamaConfig(**overrides)


def test_the_plan_counts_active_parameters_in_model_flops():
    """``zjax plan``: total and active parameters (the chosen and shared experts), and model
    FLOPs (MFU's numerator) of the active ones: 6 N_active + 12 L H Q T per token."""
    config = zjax.load_config("configs/llama-tiny.yaml", [
        "model.n_experts=4", "model.experts_per_token=2", "model.n_shared_experts=1",
        "model.moe_d_ff=64", "data.path=", "data.batch_size=8"])
    report = zjax.plan(config)
    m = config.model
    routed = m.n_layers * m.n_experts * 3 * m.d_model * 64
    assert report.active_params == report.n_params - routed // 2  # 2 of 4 experts a token
    attention = 12 * m.n_layers * m.n_heads * m.head_width * config.data.seq_len
    assert report.flops["per_token"] == 6 * report.active_params + attention
    assert f"{report.n_params:,} parameters ({report.active_params:,} active per token)" \
        in report.table()
