"""Hugging Face Llama-family checkpoints and their logits without torch or zjax: a float64 numpy
forward written from transformers 4.57's modelling files (``modeling_llama.py``,
``modeling_mistral.py``, ``modeling_qwen2.py``, ``modeling_qwen3.py``, ``modeling_phi3.py``,
``modeling_gemma.py``, ``modeling_gemma2.py``, ``modeling_gemma3.py``, ``modeling_mixtral.py``,
``modeling_qwen3_moe.py``),
and tiny random checkpoints written with transformers' own config classes and the tensor
names of those files' ``state_dict``.

The reference is itself checked against transformers' Flax Llama and Mistral
(tests/test_hf_families.py), so a shared mistake in zjax and here would show there.
Tolerance: fp32 zjax against this float64 forward differs by rounding only (~1e-6 on logits
of O(1)); the tests allow 1e-4, as the issue asks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rope_theta=1000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
# each family's own keys on top (Qwen3's heads wider than hidden_size / heads, as Qwen3's are)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 5}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "gemma": ("GemmaConfig", {"head_dim": 24, "hidden_act": "gelu_pytorch_tanh"}),
    "phi3": ("Phi3Config", {"sliding_window": 6, "pad_token_id": 0, "bos_token_id": 1,
                            "eos_token_id": 2}),
    # soft-caps small enough to bite at these weights; the window shorter than the tokens
    "gemma2": ("Gemma2Config", {"head_dim": 24, "sliding_window": 5, "query_pre_attn_scalar": 20,
                                "attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0}),
    # mixtures: 4 experts, 2 a token (Qwen3-MoE's experts narrower than intermediate_size)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 40, "norm_topk_prob": True}),
    # windowed, windowed, global (a 2:1 pattern); the global layer's rotary scaled linearly
    "gemma3": ("Gemma3TextConfig", {"architectures": ["Gemma3ForCausalLM"], "head_dim": 24,
                                    "num_hidden_layers": 3, "sliding_window": 4,
                                    "sliding_window_pattern": 3, "query_pre_attn_scalar": 16,
                                    "rope_local_base_freq": 100.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
}
_GEMMAS = ("gemma", "gemma2", "gemma3_text")


def tiny_config(family: str, **changes) -> dict:
    """The ``config.json`` (as a dict) of a tiny ``family`` model, made by transformers."""
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**{
        **TINY, "architectures": [name.replace("Config", "ForCausalLM")], **extra, **changes})
    return json.loads(config.to_json_string())


def tensor_names(hf: dict) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` names and shapes of a Llama-family model as transformers builds it."""
    d, hd = hf["hidden_size"], hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    h, kv, ff = hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"]
    qwen2, qwen3 = hf["model_type"] == "qwen2", hf["model_type"] in ("qwen3", "qwen3_moe")
    names = {"model.embed_tokens.weight": (hf["vocab_size"], d), "model.norm.weight": (d,)}
    if not hf.get("tie_word_embeddings"):
        names["lm_head.weight"] = (hf["vocab_size"], d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                  p + "self_attn.q_proj.weight": (h * hd, d),
                  p + "self_attn.k_proj.weight": (kv * hd, d),
                  p + "self_attn.v_proj.weight": (kv * hd, d),
                  p + "self_attn.o_proj.weight": (d, h * hd),
                  p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                  p + "mlp.down_proj.weight": (d, ff)}
        if _experts(hf):  # the MLP is a mixture: a router and E experts
            for name in ("gate_proj", "up_proj", "down_proj"):
                del names[p + f"mlp.{name}.weight"]
            names |= _expert_names(hf, p)
        if qwen2:  # Qwen2Attention: bias=True on q, k, v
            names |= {p + "self_attn.q_proj.bias": (h * hd,),
                      p + "self_attn.k_proj.bias": (kv * hd,),
                      p + "self_attn.v_proj.bias": (kv * hd,)}
        if qwen3 or hf["model_type"] == "gemma3_text":  # q_norm, k_norm = RMSNorm(head_dim)
            names |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if _sandwich(hf):  # Gemma2DecoderLayer: four norms
            names |= {p + "pre_feedforward_layernorm.weight": (d,),
                      p + "post_feedforward_layernorm.weight": (d,)}
    return _fuse(hf, names) if hf["model_type"] == "phi3" else names


def _experts(hf: dict) -> int:
    return hf.get("num_local_experts") or hf.get("num_experts") or 0


def _expert_names(hf: dict, p: str) -> dict:
    """modeling_mixtral's ``block_sparse_moe`` (``gate``; ``experts.{e}.w1``, ``w3``, ``w2``:
    gate, up, down) or modeling_qwen3_moe's ``mlp`` (``gate``; ``experts.{e}.gate_proj`` ...,
    ``moe_intermediate_size`` wide)."""
    d = hf["hidden_size"]
    if hf["model_type"] == "mixtral":
        ff, base, proj = hf["intermediate_size"], p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        ff, base, proj = hf["moe_intermediate_size"], p + "mlp.", ("gate_proj", "up_proj",
                                                                   "down_proj")
    names = {base + "gate.weight": (_experts(hf), d)}
    for e in range(_experts(hf)):
        x = f"{base}experts.{e}."
        names |= {x + f"{proj[0]}.weight": (ff, d), x + f"{proj[1]}.weight": (ff, d),
                  x + f"{proj[2]}.weight": (d, ff)}
    return names


def _mixture(hf, t, p, y):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: a softmax over the experts, the top
    ``num_experts_per_tok`` kept (renormalised: always in Mixtral, where ``norm_topk_prob`` in
    Qwen3-MoE), each chosen expert's SwiGLU output weighted and summed."""
    names = list(_expert_names(hf, p))
    logits = y @ t[names[0]].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = hf["num_experts_per_tok"]
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, top, axis=-1)
    if hf["model_type"] == "mixtral" or hf.get("norm_topk_prob"):
        weights = weights / weights.sum(-1, keepdims=True)
    out = np.zeros_like(y)
    for e in range(_experts(hf)):
        gate, up, down = (t[n] for n in names[1 + 3 * e: 4 + 3 * e])
        h = _act(hf, y @ gate.T) * (y @ up.T) @ down.T
        out += np.sum(np.where(top == e, weights, 0.0), axis=-1)[:, None] * h
    return out


def _fuse(hf: dict, names: dict) -> dict:
    """Phi-3's names: q, k, v rows stacked in ``qkv_proj``, gate and up in ``gate_up_proj``
    (modeling_phi3: ``qkv[..., :query_pos]``, then keys, then values; ``chunk(2)``: gate
    first)."""
    out = {}
    for name, shape in names.items():
        if ".self_attn.q_proj." in name:
            out[name.replace("q_proj", "qkv_proj")] = (
                shape[0] + 2 * names[name.replace("q_proj", "k_proj")][0], shape[1])
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = (2 * shape[0], shape[1])
        elif not any(f".{x}_proj." in name for x in ("k", "v", "up")):
            out[name] = shape
    return out


def _unfuse(hf: dict, t: dict) -> dict:
    t = dict(t)
    h, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or hf["hidden_size"] // h
    for name in [n for n in t if "qkv_proj" in n]:
        qkv = t.pop(name)
        base = name.replace("qkv_proj", "{}_proj")
        t[base.format("q")], t[base.format("k")], t[base.format("v")] = np.split(
            qkv, [h * hd, (h + kv) * hd], axis=0)
    for name in [n for n in t if "gate_up_proj" in n]:
        t[name.replace("gate_up", "gate")], t[name.replace("gate_up", "up")] = np.split(
            t.pop(name), 2, axis=0)
    return t


def random_tensors(hf: dict, seed: int = 0, names: dict | None = None
                   ) -> dict[str, np.ndarray]:
    """Random float32 weights (of ``names``, default the Llama family's): norms near 1 and
    biases near 0 but random, so a misplaced one cannot hide behind ones or zeros."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in (names or tensor_names(hf)).items():
        x = rng.standard_normal(shape).astype(np.float32)
        out[name] = 1 + 0.1 * x if "norm" in name else (0.1 if "bias" in name else 0.08) * x
    return out


def write_checkpoint(directory: Path, hf: dict, tensors: dict[str, np.ndarray]) -> Path:
    """``config.json`` and ``model.safetensors`` as ``save_pretrained`` writes them."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _rms(x, w, eps, plus_one=False):
    # GemmaRMSNorm: x * (1 + w); the others x * w
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + w if plus_one else w)


def _gemma(hf):
    return hf["model_type"] in _GEMMAS


def _sandwich(hf):  # Gemma 2 and 3: norms on the sublayers' outputs too
    return hf["model_type"] in _GEMMAS[1:]


def _act(hf, x):
    """ACT2FN[hidden_act] (Gemma 2/3: hidden_activation): silu, or Gemma's GELU (tanh
    approximation unless ``gelu``)."""
    act = hf.get("hidden_activation") if _sandwich(hf) else hf.get("hidden_act", "silu")
    if act == "silu":
        return x / (1 + np.exp(-x))
    if act == "gelu":
        from math import erf

        return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _rotary(x, positions, inv, gain=1.0):  # [T, heads, hd]; rotate_half of modeling_llama
    hd = x.shape[-1]
    ang = positions[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    cos, sin = cos * gain, sin * gain  # transformers' attention_scaling (YaRN's)
    half = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
    return x * cos[:, None] + half * sin[:, None]


def _yarn(hf, inv, hd):
    """transformers' ``_compute_yarn_parameters``, transcribed: (frequencies, attention
    scaling)."""
    s, base = hf["rope_scaling"], hf.get("rope_theta", 10000.0)
    factor, old = s["factor"], s.get("original_max_position_embeddings") or \
        hf["max_position_embeddings"]
    mscale = lambda scale, m=1: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    gain = s.get("attention_factor")
    if gain is None:
        gain = (mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
                if s.get("mscale") and s.get("mscale_all_dim") else mscale(factor))
    dim_of = lambda rot: hd * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(hd // 2) - low) / (high - low), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp), gain


def _longrope(hf, inv, n):
    """transformers' ``_compute_longrope_parameters`` and its per-forward choice
    (``_longrope_frequency_update``): the long factors when the forward's ``n`` positions
    pass ``original_max_position_embeddings``."""
    s = hf["rope_scaling"]
    original = hf.get("original_max_position_embeddings")
    factor = hf["max_position_embeddings"] / original if original else s.get("factor")
    original = original or hf["max_position_embeddings"]
    gain = s.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(s["long_factor"] if n > original else s["short_factor"], np.float64)
    return inv / ext, gain


def _rope(hf, sliding, hd, n=0):
    """(frequencies, cos/sin gain) of a layer for a forward of ``n`` positions: Gemma 3's
    windowed layers have their own, unscaled; linear, YaRN or longrope scaling."""
    if sliding and hf["model_type"] == "gemma3_text":
        return 1.0 / hf["rope_local_base_freq"] ** (np.arange(0, hd, 2) / hd), 1.0
    inv = 1.0 / hf.get("rope_theta", 10000.0) ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        return inv / scaling["factor"], 1.0
    kind = scaling.get("rope_type", scaling.get("type"))  # Phi-3's configs say "type"
    if kind == "yarn":
        return _yarn(hf, inv, hd)
    if kind == "longrope":
        return _longrope(hf, inv, n)
    return inv, 1.0


def _window(hf, i):
    """Layer ``i``'s sliding window, or None (Gemma 2/3: by ``layer_types``)."""
    if _sandwich(hf):
        return hf["sliding_window"] if hf["layer_types"][i] == "sliding_attention" else None
    if hf["model_type"] in ("mistral", "phi3"):
        return hf.get("sliding_window")
    return None


def _attention(hf, t, p, x, i):
    d, h, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or d // h
    eps, window = hf["rms_norm_eps"], _window(hf, i)
    n = len(x)
    inv, gain = _rope(hf, window is not None, hd, n)

    def proj(name, heads):
        y = x @ t[p + f"self_attn.{name}_proj.weight"].T
        if p + f"self_attn.{name}_proj.bias" in t:
            y = y + t[p + f"self_attn.{name}_proj.bias"]
        y = y.reshape(n, heads, hd)
        norm = t.get(p + f"self_attn.{name}_norm.weight")  # Qwen3: before rotary
        return y if norm is None else _rms(y, norm, eps, _gemma(hf))

    pos = np.arange(n, dtype=np.float64)
    q, k = (_rotary(proj(x_, heads), pos, inv, gain) for x_, heads in (("q", h), ("k", kv)))
    v = proj("v", kv)
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # repeat_kv
    scale = hf["query_pre_attn_scalar"] ** -0.5 if _sandwich(hf) else hd ** -0.5
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    cap = hf.get("attn_logit_softcapping") if _sandwich(hf) else None
    if cap is not None:  # before the mask (eager_attention_forward of modeling_gemma2)
        scores = cap * np.tanh(scores / cap)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    ok = j <= i
    if window is not None:
        ok &= j > i - window  # masking_utils.sliding_window_overlay
    scores = np.where(ok, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, v).reshape(n, h * hd)
    return out @ t[p + "self_attn.o_proj.weight"].T


def logits(hf: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """Float64 logits ``[B, T, vocab]`` of the model for int ``tokens`` ``[B, T]``."""
    t = _unfuse(hf, {k: np.asarray(v, np.float64) for k, v in tensors.items()})
    eps = hf["rms_norm_eps"]
    head = t["model.embed_tokens.weight"] if hf.get("tie_word_embeddings") else t["lm_head.weight"]
    one = _gemma(hf)
    rows = []
    for seq in np.asarray(tokens):
        x = t["model.embed_tokens.weight"][seq]
        if one:  # GemmaModel: the embeddings times sqrt(hidden_size)
            x = x * hf["hidden_size"] ** 0.5
        for i in range(hf["num_hidden_layers"]):
            x = _layer(hf, t, f"model.layers.{i}.", x, i)
        out = _rms(x, t["model.norm.weight"], eps, one) @ head.T
        cap = hf.get("final_logit_softcapping") if _sandwich(hf) else None
        rows.append(out if cap is None else cap * np.tanh(out / cap))
    return np.stack(rows)


def _layer(hf, t, p, x, i):
    """One decoder layer: Llama's, or Gemma 2/3's with norms on both sublayers' outputs
    (where ``post_attention_layernorm`` is the attention's output norm)."""
    eps, one = hf["rms_norm_eps"], _gemma(hf)

    def norm(name, y):
        return _rms(y, t[p + f"{name}.weight"], eps, one)

    att = _attention(hf, t, p, norm("input_layernorm", x), i)
    if _sandwich(hf):
        x = x + norm("post_attention_layernorm", att)
        y = norm("pre_feedforward_layernorm", x)
    else:
        x = x + att
        y = norm("post_attention_layernorm", x)
    if _experts(hf):
        mlp = _mixture(hf, t, p, y)
    else:
        mlp = (_act(hf, y @ t[p + "mlp.gate_proj.weight"].T)
               * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return x + (norm("post_feedforward_layernorm", mlp) if _sandwich(hf) else mlp)


def greedy(hf: dict, tensors: dict[str, np.ndarray], prompt: np.ndarray, n: int) -> np.ndarray:
    """``n`` greedy tokens after each ``prompt`` row (the full forward at every step)."""
    seq = np.asarray(prompt)
    for _ in range(n):
        seq = np.concatenate([seq, logits(hf, tensors, seq)[:, -1].argmax(-1)[:, None]], axis=1)
    return seq[:, prompt.shape[1]:]
