"""Gemma 1, 2 and 3 as Llama-family records (transformers 4.57's ``modeling_gemma*.py``):

- ``GemmaForCausalLM`` (Gemma 1): RMSNorm as ``x * (1 + w)``, embeddings times sqrt(d_model),
  a GELU-gated MLP, tied head, an explicit ``head_dim`` (256). The activation is
  ``hidden_act``, which transformers' PyTorch model reads (its Flax model reads
  ``hidden_activation``): a config whose two disagree is refused.
- ``Gemma2ForCausalLM``: Gemma 1's block with an RMSNorm on each sublayer's output before the
  residual add (so its ``post_attention_layernorm`` is the attention's *output* norm and
  ``pre_feedforward_layernorm`` the MLP's input norm, where Llama's ``post_attention_layernorm``
  is the MLP's input norm), attention and final logit soft-capping, scores scaled by
  ``query_pre_attn_scalar ** -0.5``, and ``layer_types``: sliding-window layers between global
  ones. The activation is ``hidden_activation`` (``hidden_act`` is read by nothing).
- ``Gemma3ForCausalLM`` (``gemma3_text``): Gemma 2's block with Qwen3's query/key head norms
  (as ``1 + w``), no soft-caps by default, a 5:1 local:global pattern, and the windowed layers'
  own unscaled rotary base (``rope_local_base_freq``) while the global ones take
  ``rope_theta`` and ``rope_scaling`` (``linear`` on the 4B+ models).

``layer_types`` become ``model.sliding_window`` and ``model.global_every``: every layer
windowed, none, or every k-th global (``(i + 1) % k == 0``) and the rest windowed; any other
pattern is refused by name. A config without ``layer_types`` (written before transformers 4.53)
has its class's default: every second layer global (Gemma 2), or every
``sliding_window_pattern``-th (Gemma 3, 6).
"""

from __future__ import annotations

import functools
from typing import Any

from zjax.errors import CheckpointError
from zjax.hf._layout import Leaf, number
from zjax.hf._llama import ANY, LEAVES, Family, family_layout

__all__ = ["GEMMA", "GEMMA2", "GEMMA3"]

# hidden_act (transformers' ACT2FN names) -> model.mlp_activation
_GELUS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
          "gelu": "gelu"}
_ACT = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _gemma_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    other = hf.get("hidden_activation")
    if other is not None and _GELUS.get(other) != _GELUS.get(act):
        raise CheckpointError(
            f"{source}: hidden_act = {act!r} and hidden_activation = {other!r} disagree "
            "(transformers' PyTorch Gemma reads the first, its Flax Gemma the second); set "
            "both to the activation the weights were trained with")
    return {"mlp_activation": _GELUS[act], "norm_plus_one": True, "embed_scale": True}


def _gemma_to_hf(cfg) -> dict[str, Any]:
    act = _ACT[cfg.mlp_activation]
    return {"hidden_act": act, "hidden_activation": act}


GEMMA = family_layout(Family(
    architecture="GemmaForCausalLM", model_type="gemma",
    fixed={"attention_bias": (False, None), "hidden_act": (*_GELUS, None)},
    mapped=("hidden_act",), inert=("hidden_activation",),
    options=_gemma_options, to_hf=_gemma_to_hf,
    model={"mlp_activation": ANY, "norm_plus_one": True, "embed_scale": True}))


def _pattern(hf: dict[str, Any], source: str, every: int) -> dict[str, Any]:
    """``model.sliding_window`` and ``model.global_every`` of ``layer_types`` (or, where a
    config has none, of ``every``: its class's default, every ``every``-th layer global)."""
    n = number(hf, "num_hidden_layers", int, source=source)
    every = number({"sliding_window_pattern": every}, "sliding_window_pattern", int,
                   source=source)
    if every < 1:
        raise CheckpointError(f"{source}: sliding_window_pattern = {every}; expected an "
                              "integer >= 1 (every k-th layer global)")
    kinds = hf.get("layer_types") or [_SLIDING if (i + 1) % every else _FULL for i in range(n)]
    window = number(hf, "sliding_window", int, source=source, none=True)
    if (not isinstance(kinds, list) or len(kinds) != n
            or not all(isinstance(k, str) for k in kinds) or not set(kinds) <= {_SLIDING, _FULL}):
        raise CheckpointError(f"{source}: layer_types = {kinds!r}: zjax reads "
                              f"{_SLIDING!r} and {_FULL!r}, one per layer ({n})")
    if _SLIDING not in kinds:
        return {"sliding_window": None}
    if window is None:
        raise CheckpointError(f"{source}: layer_types has {_SLIDING!r} layers but "
                              "sliding_window is null")
    if _FULL not in kinds:
        return {"sliding_window": window}
    k = kinds.index(_FULL) + 1
    if kinds != [_SLIDING if (i + 1) % k else _FULL for i in range(n)]:
        raise CheckpointError(f"{source}: layer_types = {kinds!r} is not supported: zjax "
                              "reads every layer alike, or every k-th full_attention and the "
                              "others sliding_attention")
    return {"sliding_window": window, "global_every": k}


def _layer_types(cfg) -> list[str]:
    return [_SLIDING if cfg.windowed(i) else _FULL for i in range(cfg.n_layers)]


def _gemma2_options(hf: dict[str, Any], source: str, *, every: int = 2) -> dict[str, Any]:
    num = functools.partial(number, hf, source=source)
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    head = num("head_dim", int, none=True) or (num("hidden_size", int)
                                               // num("num_attention_heads", int))
    scalar = num("query_pre_attn_scalar", float)
    pattern = _pattern(hf, source, hf.get("sliding_window_pattern",
                                          hf.get("_sliding_window_pattern", every)))
    cap = {key: num(name, float, none=True) for key, name in (
        ("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping"))}
    return {"mlp_activation": _GELUS[act], "norm_plus_one": True, "embed_scale": True,
            "post_norms": True, **pattern, **cap,
            "query_pre_attn_scalar": None if scalar == head else scalar}


def _gemma2_to_hf(cfg) -> dict[str, Any]:
    return {**_gemma_to_hf(cfg),
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_width,
            "sliding_window": cfg.sliding_window, "layer_types": _layer_types(cfg),
            "attn_logit_softcapping": cfg.attn_softcap,
            "final_logit_softcapping": cfg.final_softcap}


def _gemma2_table(cfg) -> tuple[Leaf, ...]:
    """Llama's tensor names, the MLP's input norm as ``pre_feedforward_layernorm`` and the
    sublayers' output norms as ``post_attention_layernorm`` and ``post_feedforward_layernorm``."""
    layer = "model.layers.{i}."
    out = [Leaf(leaf.keys, f"{layer}pre_feedforward_layernorm.weight", False)
           if leaf.keys[-2:] == ("ln2", "scale") else leaf for leaf in LEAVES]
    return (*out, Leaf(("blocks", "layers", "post_attn_norm", "scale"),
                       f"{layer}post_attention_layernorm.weight", False),
            Leaf(("blocks", "layers", "post_mlp_norm", "scale"),
                 f"{layer}post_feedforward_layernorm.weight", False))


_GEMMA2_MODEL = {"mlp_activation": ANY, "norm_plus_one": True, "embed_scale": True,
                 "post_norms": True, "sliding_window": ANY, "global_every": ANY,
                 "attn_softcap": ANY, "final_softcap": ANY, "query_pre_attn_scalar": ANY}
_GEMMA2_MAPPED = ("hidden_activation", "query_pre_attn_scalar", "sliding_window",
                  "layer_types", "attn_logit_softcapping", "final_logit_softcapping")

GEMMA2 = family_layout(Family(
    architecture="Gemma2ForCausalLM", model_type="gemma2",
    fixed={"attention_bias": (False, None), "hidden_activation": (*_GELUS, None)},
    mapped=_GEMMA2_MAPPED, inert=("hidden_act", "sliding_window_size"),
    options=_gemma2_options, to_hf=_gemma2_to_hf, model=_GEMMA2_MODEL, table=_gemma2_table))


def _gemma3_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    out = {**_gemma2_options(hf, source, every=6), "qk_norm": True}
    if out["sliding_window"] is not None:  # the windowed layers' rotary: own base, unscaled
        out["local_rope_theta"] = number(hf, "rope_local_base_freq", float, source=source)
    return out


def _gemma3_to_hf(cfg) -> dict[str, Any]:
    return {**_gemma2_to_hf(cfg), "rope_local_base_freq": cfg.local_rope_theta or 10000.0}


GEMMA3 = family_layout(Family(
    architecture="Gemma3ForCausalLM", model_type="gemma3_text",
    fixed={"attention_bias": (False, None), "hidden_activation": (*_GELUS, None),
           "use_bidirectional_attention": (False, None)},
    mapped=(*_GEMMA2_MAPPED, "rope_local_base_freq"),
    inert=("hidden_act", "sliding_window_pattern", "_sliding_window_pattern"),
    options=_gemma3_options, to_hf=_gemma3_to_hf,
    model={**_GEMMA2_MODEL, "qk_norm": True, "local_rope_theta": ANY}, table=_gemma2_table))
