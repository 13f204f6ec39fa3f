"""The Llama-family architectures zjax reads and writes, each as what its ``config.json`` adds
to Llama's (transformers 4.57's modelling files):

- ``LlamaForCausalLM``: the base (``attention_bias``, ``mlp_bias`` and ``pretraining_tp``
  only at their defaults).
- ``MistralForCausalLM``: Llama's block, ``sliding_window`` (a query sees the window of
  positions ending at its own: transformers' ``kv_idx > q_idx - sliding_window``).
- ``Qwen2ForCausalLM`` (Qwen2 and 2.5): biases on q, k and v (always: its attention has no
  switch), none on the output projection.
- ``Qwen3ForCausalLM``: RMSNorm over each query and key head before rotary, an explicit
  ``head_dim``, no biases.
- ``Phi3ForCausalLM``: Llama's computation with fused tensors: ``qkv_proj`` (the query heads,
  then the key heads, then the value heads) and ``gate_up_proj`` (gate, then up); Mistral's
  ``sliding_window``. The 128k variants' ``rope_scaling: longrope`` is refused (not yet
  implemented), as are dropout and partial rotary.

Gemma 1, 2 and 3 are in ``_gemma.py``.

Qwen's sliding-window layers (``use_sliding_window: true``) are refused; with it false, as in
every released Qwen2/2.5/3 checkpoint, ``sliding_window`` and ``max_window_layers`` change
nothing.
"""

from __future__ import annotations

from typing import Any

from zjax.errors import CheckpointError
from zjax.hf._layout import Leaf
from zjax.hf._llama import ANY, LEAVES, Family, family_layout

__all__ = ["LLAMA", "MISTRAL", "PHI3", "QWEN2", "QWEN3"]


def _full_attention(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen's ``layer_types``: every layer full attention (the sliding ones are refused)."""
    kinds = hf.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        raise CheckpointError(f"{source}: layer_types = {kinds!r}: zjax supports Qwen "
                              "models whose layers are all full_attention")
    return {}


def _qwen_to_hf(cfg) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layers,
            "layer_types": ["full_attention"] * cfg.n_layers}


_QWEN_INERT = ("sliding_window", "max_window_layers", "layer_types")

LLAMA = family_layout(Family(
    architecture="LlamaForCausalLM", model_type="llama",
    fixed={"attention_bias": (False, None), "mlp_bias": (False, None),
           "pretraining_tp": (1, None)}))

MISTRAL = family_layout(Family(
    architecture="MistralForCausalLM", model_type="mistral", fixed={},
    mapped=("sliding_window",),
    options=lambda hf, source: {"sliding_window": hf.get("sliding_window")},
    to_hf=lambda cfg: {"sliding_window": cfg.sliding_window},
    model={"sliding_window": ANY}))

QWEN2 = family_layout(Family(
    architecture="Qwen2ForCausalLM", model_type="qwen2",
    fixed={"use_sliding_window": (False, None)}, inert=_QWEN_INERT,
    options=lambda hf, source: {"qkv_bias": True, **_full_attention(hf, source)},
    to_hf=_qwen_to_hf, model={"qkv_bias": True}))

QWEN3 = family_layout(Family(
    architecture="Qwen3ForCausalLM", model_type="qwen3",
    fixed={"use_sliding_window": (False, None), "attention_bias": (False, None)},
    inert=_QWEN_INERT,
    options=lambda hf, source: {"qk_norm": True, **_full_attention(hf, source)},
    to_hf=_qwen_to_hf, model={"qk_norm": True}))


def _phi3_table(cfg) -> tuple[Leaf, ...]:
    """Llama's tensor names, but q, k, v in one ``qkv_proj`` and gate, up in ``gate_up_proj``."""
    fused = {"wq": ("self_attn.qkv_proj", 0), "wk": ("self_attn.qkv_proj", 1),
             "wv": ("self_attn.qkv_proj", 2), "w_gate": ("mlp.gate_up_proj", 0),
             "w_up": ("mlp.gate_up_proj", 1)}
    heads = (cfg.n_heads, cfg.kv_heads, cfg.kv_heads)
    out = []
    for leaf in LEAVES:
        name, k = fused.get(leaf.keys[-1], (None, None))
        if name is None:
            out.append(leaf)
        else:
            out.append(Leaf(leaf.keys, f"model.layers.{{i}}.{name}.weight", True,
                            (k, heads if name.startswith("self_attn") else 2)))
    return tuple(out)


_DROPOUT = (0, 0.0, None)
PHI3 = family_layout(Family(
    architecture="Phi3ForCausalLM", model_type="phi3",
    fixed={"resid_pdrop": _DROPOUT, "embd_pdrop": _DROPOUT,
           "partial_rotary_factor": (1, 1.0, None)},
    mapped=("sliding_window",), inert=("original_max_position_embeddings",),
    options=lambda hf, source: {"sliding_window": hf.get("sliding_window")},
    to_hf=lambda cfg: {"sliding_window": cfg.sliding_window}, model={"sliding_window": ANY},
    table=_phi3_table))
