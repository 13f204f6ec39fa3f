"""Multi-head latent attention (``model.kv_lora_rank``, DeepSeek-V2/V3's MLA).

- A Llama with latent attention gives the logits of a float64 NumPy transcription of
  transformers 4.57's ``DeepseekV3Attention`` (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``
  or one ``q_proj``, ``kv_a_proj_with_mqa`` split into the latent and the shared rotary key,
  ``kv_a_layernorm``, ``kv_b_proj``, ``apply_rotary_pos_emb_interleave`` or the plain rotation,
  ``qk_head_dim^-1/2`` scaling times YaRN's ``mscale(factor, mscale_all_dim)^2``), atol 1e-4
  in float32.
- Decoding through the key/value cache gives the full forward's logits.
- A ZeRO-3 step over 8 devices equals single-device optax (``helpers.assert_matches_reference``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_matches_reference, make_tx, reference_run, train_steps
from hf_reference import _rms, _rotary, _yarn
from models import llama_reference_loss, llama_trainable, token_batches

import zjax
from zjax.models import LlamaConfig
from zjax.models.llama import Llama

MLA = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=32,
                  kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=6)


def _silu(x):
    return x / (1 + np.exp(-x))


def _attention(cfg, p, h, positions):
    """transformers' DeepseekV3Attention on ``h`` ``[T, D]`` (one sequence), zjax's weights."""
    t, heads = h.shape[0], cfg.n_heads
    nope, rope, vd, rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        q = _rms(h @ p["wq_a"], p["q_a_norm"]["scale"], cfg.norm_eps) @ p["wq_b"]
    else:
        q = h @ p["wq"]
    q = q.reshape(t, heads, nope + rope)
    kv = h @ p["wkv_a"]
    latent, k_rot = kv[:, :rank], kv[:, rank:].reshape(t, 1, rope)
    kv = (_rms(latent, p["kv_a_norm"]["scale"], cfg.norm_eps) @ p["wkv_b"]).reshape(
        t, heads, nope + vd)
    q_rot = q[..., nope:]
    if cfg.rope_interleave:  # view(d // 2, 2).transpose(-1, -2).reshape(d)
        q_rot, k_rot = (x.reshape(*x.shape[:-1], rope // 2, 2).swapaxes(-1, -2).reshape(x.shape)
                        for x in (q_rot, k_rot))
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, rope, 2, dtype=np.float64) / rope)
    gain, scale = 1.0, (nope + rope) ** -0.5
    if cfg.rope_scaling == "yarn":
        hf = {"rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_seq_len,
              "rope_scaling": {"factor": cfg.rope_factor, "mscale": cfg.rope_mscale,
                               "mscale_all_dim": cfg.rope_mscale_all_dim,
                               "original_max_position_embeddings": cfg.rope_original_max_len,
                               "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow}}
        inv, gain = _yarn(hf, inv, rope)
        if cfg.rope_mscale_all_dim:
            m = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0
            scale *= m * m
    q_rot, k_rot = _rotary(q_rot, positions, inv, gain), _rotary(k_rot, positions, inv, gain)
    q = np.concatenate([q[..., :nope], q_rot], -1)
    k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot, (t, heads, rope))], -1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", w, kv[..., nope:]).reshape(t, heads * vd)
    return out @ p["wo"]


def _layer(cfg, p, x):
    positions = np.arange(len(x), dtype=np.float64)
    x = x + _attention(cfg, p, _rms(x, p["ln1"]["scale"], cfg.norm_eps), positions)
    h = _rms(x, p["ln2"]["scale"], cfg.norm_eps)
    return x + (_silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def _trunk(cfg, params, tokens):
    x = params["embed"][tokens]
    for i in range(cfg.n_layers):
        x = _layer(cfg, jax.tree.map(lambda a, i=i: a[i], params["blocks"]["layers"]), x)
    return x


def _logits(cfg, params, tokens):
    return _rms(_trunk(cfg, params, tokens), params["ln_f"]["scale"], cfg.norm_eps) \
        @ params["head"]


def _model(cfg):
    model = Llama(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    # norm scales away from 1 and weights larger, so that every term shows in the logits
    keys = iter(jax.random.split(jax.random.key(1), 64))
    state = jax.tree.map(lambda a: a * 3 + 0.3 * jax.random.normal(next(keys), a.shape), state)
    nnx.update(model, state)
    return model, jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state))


@pytest.mark.parametrize("changes", [  # the quick loop: q-latent (DeepSeek-V3's)
    {}, pytest.param({"q_lora_rank": None}, marks=pytest.mark.slow),
    pytest.param({"rope_interleave": False}, marks=pytest.mark.slow),
    pytest.param({"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 8,
                  "rope_mscale": 1.0, "rope_mscale_all_dim": 0.7, "rope_beta_fast": 8.0,
                  "rope_beta_slow": 2.0}, marks=pytest.mark.slow),
], ids=["q-latent", "q-proj", "no-interleave", "yarn-mscale"])
def test_latent_attention_equals_transformers(changes):
    cfg = dataclasses.replace(MLA, **changes)
    model, params = _model(cfg)
    tokens = np.array([3, 17, 42, 5, 9, 60, 11, 2, 33, 7, 21, 50])
    got = np.asarray(model(jnp.asarray(tokens)[None]))[0]
    want = _logits(cfg, params, tokens)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    cache = model.init_cache(1, 16)
    prompt, rest = model.decode(jnp.asarray(tokens[:5])[None], cache, 0)
    steps = [prompt[0]]
    for i, tok in enumerate(tokens[5:]):
        logits, rest = model.decode(jnp.asarray([[tok]]), rest, 5 + i)
        steps.append(logits[0])
    # the latent decode reassociates (kv_b_proj absorbed into the query and the output), so
    # float32 rounding scales with the logits and with the CPU's vector width: up to 1.06e-4
    # at |logits| <= 10.8 on an AMD EPYC (under 1e-4 on the machine before it)
    np.testing.assert_allclose(np.concatenate(steps), got, rtol=1e-4,
                               atol=2e-5 * np.abs(got).max())


@pytest.mark.slow  # latent attention's quick case: test_latent_attention_equals_transformers
def test_a_zero3_step_equals_one_device():
    batches = token_batches(2)
    expected = reference_run(llama_trainable(MLA).init,
                             lambda p, b: llama_reference_loss(MLA)(p, b)[:2], make_tx(), batches)
    zero = zjax.ZeroConfig(stage=3, prefetch_layers=1, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")
    _, state, losses = train_steps(llama_trainable(MLA), zero, batches)
    assert_matches_reference(losses, state, expected)


DEEPSEEK = dataclasses.replace(
    MLA, n_layers=3, n_experts=8, experts_per_token=2, moe_d_ff=12, n_shared_experts=1,
    first_k_dense=1, router_score="sigmoid", router_groups=4, router_topk_groups=2,
    routed_scaling_factor=2.5, mtp_layers=1)


# slow (about 20 s each): the quick loop keeps its parts, latent attention against
# transformers, DeepSeek's router, a mixture over ``expert`` and DeepSeek-V3's import
@pytest.mark.slow
@pytest.mark.parametrize("expert", [1, 2])
def test_a_deepseek_shaped_step_equals_one_device(expert):
    """Latent attention, a dense first layer (a stack of its own) and DeepSeek-V3's router
    with a shared expert, at ZeRO-3 over ``data`` x ``expert``."""
    batches = token_batches(2)
    expected = reference_run(llama_trainable(DEEPSEEK).init,
                             lambda p, b: llama_reference_loss(DEEPSEEK)(p, b)[:2], make_tx(),
                             batches)
    zero = zjax.ZeroConfig(stage=3, prefetch_layers=1, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")
    mesh = zjax.make_mesh(zjax.MeshConfig(data=8 // expert, expert=expert))
    zstep, state, losses = train_steps(llama_trainable(DEEPSEEK), zero, batches, mesh=mesh)
    assert_matches_reference(losses, state, expected)
    assert zstep.plan.leaves_by_path["dense_blocks/layers/w_gate"].shape == (1, 32, 48)


def _ce(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[:, None], -1)[:, 0]


def test_multi_token_prediction_adds_the_token_after_next(tmp_path):
    """``model.mtp_layers: 1``: the loss is the next-token cross-entropy plus
    ``mtp_loss_coef`` times the mean cross-entropy of the token after next, predicted from
    ``eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])`` through one more layer, its norm and the
    shared head (DeepSeek-V3's module, vLLM's order), each computed here in float64."""
    from zjax.models import lm_loss

    cfg = dataclasses.replace(MLA, mtp_layers=1, mtp_loss_coef=0.3)
    model, params = _model(cfg)
    batch = np.random.default_rng(0).integers(0, 64, (2, 9))
    loss_sum, count, metrics = lm_loss(model, jnp.asarray(batch))
    eps, main, mtp = cfg.norm_eps, [], []
    for row in batch:
        inputs, targets = row[:-1], row[1:]
        h = _trunk(cfg, params, inputs)
        main.append(_ce(_rms(h, params["ln_f"]["scale"], eps) @ params["head"], targets))
        x = np.concatenate([_rms(params["embed"][targets[:-1]], params["mtp_enorm"]["scale"],
                                 eps), _rms(h[:-1], params["mtp_hnorm"]["scale"], eps)], -1)
        layer = jax.tree.map(lambda a: a[0], params["mtp_blocks"]["layers"])
        x = _layer(cfg, layer, x @ params["mtp_proj"])
        mtp.append(_ce(_rms(x, params["mtp_norm"]["scale"], eps) @ params["head"],
                       targets[1:]))
    want_mtp = np.mean(np.concatenate(mtp))
    assert float(count) == 16
    np.testing.assert_allclose(float(metrics["mtp_loss"]) / 16, want_mtp, rtol=1e-5)
    np.testing.assert_allclose(float(loss_sum) / 16,
                               np.mean(np.concatenate(main)) + 0.3 * want_mtp, rtol=1e-5)
