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
- ``MixtralForCausalLM``: Mistral's attention and a mixture of ``num_local_experts`` SwiGLU
  experts ``intermediate_size`` wide, ``num_experts_per_tok`` of them per token, the kept
  router probabilities renormalised (``block_sparse_moe.gate``, ``experts.{e}.w1`` / ``w3`` /
  ``w2``: gate, up, down); ``router_jitter_noise`` only at 0.
- ``Qwen3MoeForCausalLM``: Qwen3's attention and a mixture of ``num_experts`` experts
  ``moe_intermediate_size`` wide, renormalised where ``norm_topk_prob`` (``mlp.gate``,
  ``mlp.experts.{e}.gate_proj`` ...); every layer sparse (``decoder_sparse_step`` 1, no
  ``mlp_only_layers``).
- ``router_aux_loss_coef`` of both becomes ``model.router_aux_loss_coef`` (a training setting
  a run may change; inert to the logits, as is ``output_router_logits``, transformers' switch
  for adding it).
- ``Phi3ForCausalLM``: Llama's computation with fused tensors: ``qkv_proj`` (the query heads,
  then the key heads, then the value heads) and ``gate_up_proj`` (gate, then up); Mistral's
  ``sliding_window``. The 128k variants' ``rope_scaling: longrope`` (short and long factors,
  ``original_max_position_embeddings``) is read; dropout and partial rotary are refused.

Gemma 1, 2 and 3 are in ``_gemma.py``.

Qwen's sliding-window layers (``use_sliding_window: true``) are refused; with it false, as in
every released Qwen2/2.5/3 checkpoint, ``sliding_window`` and ``max_window_layers`` change
nothing.
"""

from __future__ import annotations

from typing import Any

from zjax.errors import CheckpointError
from zjax.hf._layout import Leaf, number
from zjax.hf._llama import ANY, LEAVES, Family, expert_leaves, family_layout

__all__ = ["LLAMA", "MISTRAL", "MIXTRAL", "PHI3", "QWEN2", "QWEN3", "QWEN3_MOE"]


def _full_attention(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen's ``layer_types``: every layer full attention (the sliding ones are refused)."""
    kinds = hf.get("layer_types")
    if kinds is None:
        return {}
    n = number(hf, "num_hidden_layers", int, source=source)
    if not isinstance(kinds, list) or len(kinds) != n:  # transformers' layer_type_validation
        raise CheckpointError(f"{source}: layer_types = {kinds!r}: expected a list of one "
                              f"kind per layer ({n}, num_hidden_layers)")
    if any(kind != "full_attention" for kind in kinds):
        raise CheckpointError(f"{source}: layer_types = {kinds!r}: zjax supports Qwen "
                              "models whose layers are all full_attention")
    return {}


def _window(hf: dict[str, Any], source: str) -> int | None:
    """``sliding_window`` (null: full attention)."""
    return number(hf, "sliding_window", int, source=source, none=True)


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
    options=lambda hf, source: {"sliding_window": _window(hf, source)},
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


def _experts(hf: dict[str, Any], source: str, count: str, width: str | None = None
             ) -> dict[str, Any]:
    """The mixture's options of a ``config.json`` whose expert count is ``count``."""
    out = {"n_experts": number(hf, count, int, source=source),
           "experts_per_token": number(hf, "num_experts_per_tok", int, source=source),
           "router_aux_loss_coef": number(hf, "router_aux_loss_coef", float, source=source)}
    return out if width is None else {**out, "moe_d_ff": number(hf, width, int, source=source)}


def _experts_to_hf(cfg, count: str) -> dict[str, Any]:
    return {count: cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}


_MIXTURE = {"n_experts": ANY, "experts_per_token": ANY}
# the aux loss's weight is a training setting (read into model.router_aux_loss_coef), and
# output_router_logits transformers' switch for adding it: neither changes the logits
_MOE_INERT = ("router_aux_loss_coef", "output_router_logits")
_MIXTRAL_LEAVES = expert_leaves("block_sparse_moe.gate", "block_sparse_moe.experts",
                                ("w1", "w3", "w2"))
MIXTRAL = family_layout(Family(
    architecture="MixtralForCausalLM", model_type="mixtral",
    fixed={"router_jitter_noise": (0, 0.0, None)},
    mapped=("sliding_window", "num_local_experts", "num_experts_per_tok"),
    inert=_MOE_INERT,
    options=lambda hf, source: {"sliding_window": _window(hf, source),
                                **_experts(hf, source, "num_local_experts")},
    to_hf=lambda cfg: {"sliding_window": cfg.sliding_window, "intermediate_size": cfg.expert_ff,
                       **_experts_to_hf(cfg, "num_local_experts")},
    model={"sliding_window": ANY, **_MIXTURE}, table=lambda cfg: _MIXTRAL_LEAVES))

_QWEN_MOE_LEAVES = expert_leaves("mlp.gate", "mlp.experts", ("gate_proj", "up_proj",
                                                             "down_proj"))
QWEN3_MOE = family_layout(Family(
    architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
    fixed={"use_sliding_window": (False, None), "attention_bias": (False, None),
           "decoder_sparse_step": (1, None), "mlp_only_layers": ([], None)},
    mapped=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
    # every layer sparse: intermediate_size (a dense layer's width) is read back, not used
    inert=(*_QWEN_INERT, *_MOE_INERT, "intermediate_size"),
    options=lambda hf, source: {
        "qk_norm": True, "router_renormalize": number(hf, "norm_topk_prob", bool, source=source),
        **_experts(hf, source, "num_experts", "moe_intermediate_size"),
        **_full_attention(hf, source)},
    to_hf=lambda cfg: {**_qwen_to_hf(cfg), **_experts_to_hf(cfg, "num_experts"),
                       "moe_intermediate_size": cfg.expert_ff,
                       "norm_topk_prob": cfg.router_renormalize},
    model={"qk_norm": True, "moe_d_ff": ANY, "router_renormalize": ANY, **_MIXTURE},
    table=lambda cfg: _QWEN_MOE_LEAVES))


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
    options=lambda hf, source: {"sliding_window": _window(hf, source)},
    to_hf=lambda cfg: {"sliding_window": cfg.sliding_window, **_phi3_longrope(cfg)},
    model={"sliding_window": ANY}, table=_phi3_table))


def _phi3_longrope(cfg) -> dict[str, Any]:
    """``longrope``'s lengths: the attention factor is read back from their ratio."""
    if cfg.rope_scaling != "longrope":
        return {}
    return {"original_max_position_embeddings": cfg.rope_original_max_len,
            "max_position_embeddings": round(cfg.rope_factor * cfg.rope_original_max_len)}
