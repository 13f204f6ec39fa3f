"""A float64 NumPy transcription of transformers 4.57's ``DeepseekV3ForCausalLM`` (its
``config.json`` and tensor names): latent attention (``DeepseekV3Attention``), dense first layers
(``first_k_dense_replace``), the sigmoid group-limited router with its correction bias
(``DeepseekV3TopkRouter``, masked groups read 0), routed experts weighted and scaled, plus the
shared experts (``DeepseekV3MoE``); and of ``DeepseekV2ForCausalLM`` (the same attention with
rotary on interleaved pairs, ``freqs_cis``; a softmax gate, ``greedy`` or
``group_limited_greedy``, scaled and not renormalised; no correction bias). V2's softmax scale
is transformers' (no YaRN ``mscale^2``) unless ``deepseek_scale``: DeepSeek's own code's.
"""

from __future__ import annotations

import json
import math

import numpy as np
from hf_reference import TINY, _rms, _rotary, _yarn, random_tensors

# 3 layers (the first dense), 4 experts in 2 groups, one group and 2 experts a token, a shared
# expert, latent attention with a query latent
DEEPSEEK = {**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 40, "n_shared_experts": 1,
            "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
            "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "routed_scaling_factor": 2.5, "architectures": ["DeepseekV3ForCausalLM"]}


V2 = {**{k: v for k, v in DEEPSEEK.items() if k not in ("n_group", "topk_group")},
      "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "greedy",
      "routed_scaling_factor": 1.0, "architectures": ["DeepseekV2ForCausalLM"]}


def deepseek_config(**changes) -> dict:
    """The ``config.json`` (as a dict) of a tiny DeepSeek-V3, made by transformers."""
    import transformers

    config = transformers.DeepseekV3Config(**{**DEEPSEEK, **changes})
    return json.loads(config.to_json_string())


def deepseek_v2_config(**changes) -> dict:
    """The ``config.json`` of a tiny DeepSeek-V2(-Lite), made by transformers."""
    import transformers

    config = transformers.DeepseekV2Config(**{**V2, **changes})
    return json.loads(config.to_json_string())


def _v2(hf: dict) -> bool:
    return hf["model_type"] == "deepseek_v2"


def deepseek_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights (norms near 1, the correction bias random) for every tensor."""
    return random_tensors(hf, seed, _names(hf))


def _names(hf: dict) -> dict[str, tuple[int, ...]]:
    d, h, v = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    nope, rope, vd = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    rank, qr, e, f = hf["kv_lora_rank"], hf["q_lora_rank"], hf["n_routed_experts"], \
        hf["moe_intermediate_size"]
    names = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
             "lm_head.weight": (v, d)}
    for i in range(hf["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        names |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                  a + "kv_a_proj_with_mqa.weight": (rank + rope, d),
                  a + "kv_a_layernorm.weight": (rank,), a + "kv_b_proj.weight": (h * (nope + vd),
                                                                              rank),
                  a + "o_proj.weight": (d, h * vd)}
        if qr:
            names |= {a + "q_a_proj.weight": (qr, d), a + "q_a_layernorm.weight": (qr,),
                      a + "q_b_proj.weight": (h * (nope + rope), qr)}
        else:
            names[a + "q_proj.weight"] = (h * (nope + rope), d)
        mlp = [("", hf["intermediate_size"])] if i < hf["first_k_dense_replace"] else [
            *((f"experts.{j}.", f) for j in range(e)),
            ("shared_experts.", f * hf["n_shared_experts"])]
        for prefix, width in mlp:
            m = f"{p}mlp.{prefix}"
            names |= {m + "gate_proj.weight": (width, d), m + "up_proj.weight": (width, d),
                      m + "down_proj.weight": (d, width)}
        if i >= hf["first_k_dense_replace"]:
            names[p + "mlp.gate.weight"] = (e, d)
            if not _v2(hf):
                names[p + "mlp.gate.e_score_correction_bias"] = (e,)
    return names


def _pairs(x, pos, inv, gain):
    """V2's ``view_as_complex(x.reshape(..., -1, 2)) * freqs_cis``, ``freqs_cis`` times the
    YaRN gain."""
    c = (x[..., 0::2] + 1j * x[..., 1::2]) * (np.exp(1j * pos[:, None] * inv) * gain)[:, None]
    return np.stack([c.real, c.imag], -1).reshape(x.shape)


def _attention(hf, t, p, h, deepseek_scale=False):
    n, heads = h.shape[0], hf["num_attention_heads"]
    nope, rope, vd = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    rank, eps, a = hf["kv_lora_rank"], hf["rms_norm_eps"], p + "self_attn."
    if hf["q_lora_rank"]:
        q = _rms(h @ t[a + "q_a_proj.weight"].T, t[a + "q_a_layernorm.weight"], eps) \
            @ t[a + "q_b_proj.weight"].T
    else:
        q = h @ t[a + "q_proj.weight"].T
    q = q.reshape(n, heads, nope + rope)
    kv = h @ t[a + "kv_a_proj_with_mqa.weight"].T
    k_rot = kv[:, rank:].reshape(n, 1, rope)
    kv = (_rms(kv[:, :rank], t[a + "kv_a_layernorm.weight"], eps)
          @ t[a + "kv_b_proj.weight"].T).reshape(n, heads, nope + vd)
    q_rot = q[..., nope:]
    inv = 1.0 / hf["rope_theta"] ** (np.arange(0, rope, 2, dtype=np.float64) / rope)
    gain, scale, scaling = 1.0, (nope + rope) ** -0.5, hf.get("rope_scaling")
    if scaling:
        inv, gain = _yarn(hf, inv, rope)
        if scaling.get("mscale_all_dim") and (not _v2(hf) or deepseek_scale):
            m = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0
            scale *= m * m
    pos = np.arange(n, dtype=np.float64)
    if _v2(hf):  # apply_rotary_emb: pairs (x[2i], x[2i + 1]) as complex numbers
        rot = lambda x: _pairs(x, pos, inv, gain)
    elif hf["rope_interleave"]:
        rot = lambda x: _rotary(x.reshape(*x.shape[:-1], rope // 2, 2).swapaxes(-1, -2)
                                .reshape(x.shape), pos, inv, gain)
    else:
        rot = lambda x: _rotary(x, pos, inv, gain)
    q = np.concatenate([q[..., :nope], rot(q_rot)], -1)
    k = np.concatenate([kv[..., :nope], np.broadcast_to(rot(k_rot), (n, heads, rope))], -1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", w, kv[..., nope:]).reshape(n, heads * vd)
    return out @ t[a + "o_proj.weight"].T


def _mlp(t, m, y):
    g, u = y @ t[m + "gate_proj.weight"].T, y @ t[m + "up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ t[m + "down_proj.weight"].T


def _moe(hf, t, p, y):
    e, k = hf["n_routed_experts"], hf["num_experts_per_tok"]
    logits = y @ t[p + "mlp.gate.weight"].T
    if _v2(hf):
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores = scores / scores.sum(-1, keepdims=True)
        if hf["topk_method"] == "greedy":
            top = np.argsort(-scores, -1, kind="stable")[:, :k]
            return _combine(hf, t, p, y, top, np.take_along_axis(scores, top, -1))
        groups, top_groups, choice = hf["n_group"], hf["topk_group"], scores
        group_scores = choice.reshape(-1, groups, e // groups).max(-1)
    else:
        groups, top_groups = hf["n_group"], hf["topk_group"]
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + t[p + "mlp.gate.e_score_correction_bias"][None]
        group_scores = np.sort(choice.reshape(-1, groups, e // groups), -1)[..., -2:].sum(-1)
    keep = np.zeros(group_scores.shape, bool)
    np.put_along_axis(keep, np.argsort(-group_scores, -1, kind="stable")[:, :top_groups], True,
                      axis=1)
    choice = np.where(np.repeat(keep, e // groups, axis=1), choice, 0.0)
    top = np.argsort(-choice, -1, kind="stable")[:, :k]
    return _combine(hf, t, p, y, top, np.take_along_axis(scores, top, -1))


def _combine(hf, t, p, y, top, weights):
    if hf["norm_topk_prob"] and not _v2(hf):  # V2's gate reads no norm_topk_prob
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * hf["routed_scaling_factor"]
    out = np.zeros_like(y)
    for j in range(hf["n_routed_experts"]):
        w = np.where(top == j, weights, 0.0).sum(-1)
        out += w[:, None] * _mlp(t, f"{p}mlp.experts.{j}.", y)
    return out + _mlp(t, f"{p}mlp.shared_experts.", y)


def deepseek_logits(hf: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray, *,
                    deepseek_scale: bool = False) -> np.ndarray:
    """Float64 logits ``[B, T, vocab]``."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    eps, rows = hf["rms_norm_eps"], []
    for seq in np.asarray(tokens):
        x = t["model.embed_tokens.weight"][seq]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = x + _attention(hf, t, p, _rms(x, t[p + "input_layernorm.weight"], eps),
                               deepseek_scale)
            y = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
            x = x + (_mlp(t, p + "mlp.", y) if i < hf["first_k_dense_replace"]
                     else _moe(hf, t, p, y))
        rows.append(_rms(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T)
    return np.stack(rows)


def deepseek_greedy(hf: dict, tensors: dict, prompt: np.ndarray, n: int) -> np.ndarray:
    """``n`` greedy tokens after each ``prompt`` row."""
    seq = np.asarray(prompt)
    for _ in range(n):
        nxt = deepseek_logits(hf, tensors, seq)[:, -1].argmax(-1)[:, None]
        seq = np.concatenate([seq, nxt], axis=1)
    return seq[:, prompt.shape[1]:]
