"""DeepSeek-V3's router (``model.router_score: sigmoid``) and its auxiliary-loss-free balancing.

- :func:`zjax.nn.moe.route_sigmoid` equals a NumPy transcription of transformers 4.57's
  ``DeepseekV3TopkRouter`` (sigmoid scores, the selection bias, two-best group scores, the
  groups outside the ``topk_group`` best read 0, the kept scores renormalised and scaled):
  the same experts and weights to 1e-6.
- The bias's update (:func:`zjax.step.optim.with_router_bias` on the load error that
  :func:`zjax.nn.moe.load_feedback` hands it as its gradient) drives a router that sends every
  token to 4 of 16 experts to max/mean load under 1.2 in 100 steps with no auxiliary loss;
  without it the load stays skewed.
- Trained through the CLI, the bias moves (not by the optimizer: no weight decay, no moments),
  ``moe_max_violation`` is logged and falls, and a resumed run's bias equals an uninterrupted
  run's bit for bit.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import latest_checkpoint, zjax_main

from zjax.nn.moe import Experts, Scoring, moe_ffn, route_sigmoid
from zjax.step.optim import with_router_bias


def _hf_router(logits, bias, *, k, n_group, topk_group, norm, scaling):
    """transformers' ``DeepseekV3TopkRouter.forward`` after the linear, in NumPy."""
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias[None]
    n, e = choice.shape
    grouped = choice.reshape(n, n_group, e // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((n, n_group), bool)
    np.put_along_axis(mask, best, True, axis=1)
    choice = np.where(np.repeat(mask, e // n_group, axis=1), choice, 0.0)  # masked_fill 0.0
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, idx, axis=-1)
    if norm:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return idx, weights * scaling


@pytest.mark.parametrize("norm", [True, False])
def test_route_sigmoid_equals_transformers_router(norm):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=16).astype(np.float32)  # some choices go negative
    kw = dict(k=3, n_group=4, topk_group=2, norm=norm, scaling=2.5)
    want_idx, want_w = _hf_router(logits.astype(np.float64), bias.astype(np.float64), **kw)
    got = route_sigmoid(jnp.asarray(logits), jnp.asarray(bias), k=3, groups=4, topk_groups=2,
                        renormalize=norm, scaling=2.5)
    order = np.argsort(np.asarray(got.experts), axis=-1)
    want_order = np.argsort(want_idx, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got.experts), order, -1),
                                  np.take_along_axis(want_idx, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got.weights), order, -1),
                               np.take_along_axis(want_w, want_order, -1), rtol=1e-6)


def _balance(speed: float, steps: int) -> float:
    """Max over mean expert load after ``steps`` updates of the bias alone (the router and
    experts fixed), fresh tokens each step; every token's constant feature pulls it to
    experts 0-3 (of 16, in 4 groups, 2 chosen)."""
    e, k, n, d = 16, 2, 4096, 16
    kr, kw = jax.random.split(jax.random.key(0))
    router = (0.3 * jax.random.normal(kr, (d, e))).at[0, :4].add(1.5)
    w = Experts(*(0.1 * jax.random.normal(kk, s) for kk, s in
                  zip(jax.random.split(kw, 3), [(e, d, 8), (e, d, 8), (e, 8, d)], strict=True)))
    params = {"router_bias": jnp.zeros(e)}
    tx = with_router_bias(optax.sgd(0.0), speed)

    def routed(p, x):
        return moe_ffn(x, router, w, k=k, scoring=Scoring(p["router_bias"], 4, 2))[0]

    @jax.jit
    def step(p, state, x):
        grads = jax.grad(lambda p: jnp.sum(routed(p, x)))(p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    state = tx.init(params)
    for i in range(steps):
        x = jax.random.normal(jax.random.key(100 + i), (n, d)).at[:, 0].set(1.0)
        params, state = step(params, state, x)
    x = jax.random.normal(jax.random.key(7), (4 * n, d)).at[:, 0].set(1.0)
    top = route_sigmoid(x @ router, params["router_bias"], k=k, groups=4, topk_groups=2)
    load = np.bincount(np.asarray(top.experts).reshape(-1), minlength=e)
    return float(load.max() / load.mean())


def test_the_bias_balances_a_skewed_router_without_an_aux_loss():
    assert _balance(0.0, 5) > 3.0  # the skew: 4 experts take nearly everything
    assert _balance(0.002, 100) < 1.2


_DS = ("model.n_experts=8", "model.experts_per_token=2", "model.moe_d_ff=32",
       "model.router_score=sigmoid", "model.router_groups=4", "model.router_topk_groups=2",
       "model.routed_scaling_factor=2.5", "model.router_bias_update_speed=0.01",
       "model.router_aux_loss_coef=0", "model.n_layers=2", "data.seq_len=64",
       "train.log_every=2", "train.eval_every=0", "mesh.expert=2", "checkpoint.every=3")


@pytest.mark.slow
def test_the_bias_trains_logs_and_resumes_exactly(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert zjax_main("train", "configs/llama-tiny.yaml", *_DS, "train.steps=6",
                     "--run-dir", str(whole)).returncode == 0
    assert zjax_main("train", "configs/llama-tiny.yaml", *_DS, "train.steps=3",
                     "--run-dir", str(split)).returncode == 0
    assert zjax_main("train", "configs/llama-tiny.yaml", *_DS, "train.steps=6",
                     "--run-dir", str(split)).returncode == 0
    overrides = [*_DS, "train.steps=6"]
    biases = [latest_checkpoint(run, overrides, config="configs/llama-tiny.yaml")[1]
              ["params"]["blocks"]["layers"]["router_bias"] for run in (whole, split)]
    np.testing.assert_array_equal(biases[0], biases[1])
    # each step moves each bias by the speed or not at all (sign of the load error)
    steps = np.abs(biases[0]) / 0.01
    assert np.any(steps > 0.5) and np.allclose(steps, np.round(steps), atol=1e-3)
    logged = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe_max_violation"] >= 0 for r in logged)


def test_no_hf_architecture_is_claimed_for_a_deepseek_router():
    """Mixtral's and Qwen3-MoE's layouts cannot say sigmoid scores, groups or the scaling
    factor: an export would compute another function, so it is refused by key."""
    from zjax.errors import ConfigError
    from zjax.hf._layouts import layout_for_model
    from zjax.models import LlamaConfig

    with pytest.raises(ConfigError, match=r"model\.router_score = 'softmax', the run 'sigmoid'"):
        layout_for_model("llama", LlamaConfig(n_experts=8, router_score="sigmoid"))
    with pytest.raises(ConfigError, match="routed_scaling_factor"):
        layout_for_model("llama", LlamaConfig(n_experts=8, routed_scaling_factor=2.5))


def test_sequence_balance_is_deepseeks_formula():
    """DeepSeek-V3's (eq. 17-20): per sequence, ``sum_i f_i P_i`` with ``f_i = E / (k T)``
    times the tokens choosing ``i`` and ``P_i`` the mean normalised score; averaged over the
    sequences; padding (mask 0) counts in neither."""
    from zjax.nn.moe import sequence_balance

    rng = np.random.default_rng(3)
    seqs, t, e, k = 4, 10, 8, 3
    logits = rng.normal(size=(seqs * t, e)).astype(np.float32)
    mask = np.ones(seqs * t, np.float32)
    mask[t - 3:t] = 0  # the first sequence's last 3 tokens are padding
    routing = route_sigmoid(jnp.asarray(logits), jnp.zeros(e), k=k)
    got = float(sequence_balance(routing, seqs, jnp.asarray(mask)))
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    norm = scores / scores.sum(-1, keepdims=True)
    top = np.asarray(routing.experts)
    want = []
    for s in range(seqs):
        rows = [i for i in range(s * t, (s + 1) * t) if mask[i]]
        f = e / (k * len(rows)) * np.array([sum(j in top[i] for i in rows) for j in range(e)])
        want.append(np.sum(f * norm[rows].mean(0)))
    np.testing.assert_allclose(got, np.mean(want), rtol=1e-5)
    grads = jax.grad(lambda lg: sequence_balance(route_sigmoid(lg, jnp.zeros(e), k=k), seqs))(
        jnp.asarray(logits))
    assert float(jnp.abs(grads).max()) > 0  # it trains the router through P
