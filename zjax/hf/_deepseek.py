"""``DeepseekV3ForCausalLM`` (DeepSeek-V3, Kimi-K2's architecture) and ``DeepseekV2ForCausalLM``
(DeepSeek-V2, V2-Lite; at the end) <-> zjax's Llama with latent
attention, a dense first stack and DeepSeek-V3's router (transformers 4.57's modelling file).

- Attention: ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` where
  ``q_lora_rank`` is null), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
  ``o_proj`` -> ``wq_a`` / ``q_a_norm`` / ``wq_b`` (``wq``), ``wkv_a``, ``kv_a_norm``,
  ``wkv_b``, ``wo`` (:mod:`zjax.models._mla`). ``rope_interleave`` is kept as a model option
  (the rotary parts are de-interleaved when computed), so no weight is permuted.
- Layers ``0 .. first_k_dense_replace - 1``: ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``
  (``intermediate_size`` wide) -> the ``dense_blocks`` stack; the rest: ``mlp.gate.weight``
  (the router), ``mlp.gate.e_score_correction_bias`` (the selection bias, ``router_bias``),
  ``mlp.experts.{e}.*`` stacked per layer, ``mlp.shared_experts.*`` -> the ``blocks`` stack,
  whose ``{i}`` counts from ``first_k_dense_replace``.
- ``head_dim`` is written as ``qk_rope_head_dim`` (what ``DeepseekV3Config`` sets and its
  rotary embedding reads). Multi-token prediction layers (``num_nextn_predict_layers``) are
  not read, as transformers reads none.
"""

from __future__ import annotations

import functools
from typing import Any

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._layout import Leaf, number
from zjax.hf._llama import ANY, Family, family_layout

__all__ = ["DEEPSEEK_V2", "DEEPSEEK_V3"]

_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def _stack(name: str, first: int, dense: bool, cfg) -> list[Leaf]:
    """The leaves of one stack whose first layer is the file's layer ``first``."""
    keys, layer = (name, "layers"), "model.layers.{i}."
    leaf = functools.partial(Leaf, first=first)
    a, m = f"{layer}self_attn.", f"{layer}mlp."
    out = [leaf((*keys, "ln1", "scale"), f"{layer}input_layernorm.weight", False),
           leaf((*keys, "ln2", "scale"), f"{layer}post_attention_layernorm.weight", False)]
    if cfg.q_lora_rank:
        out += [leaf((*keys, "wq_a"), f"{a}q_a_proj.weight", True),
                leaf((*keys, "q_a_norm", "scale"), f"{a}q_a_layernorm.weight", False),
                leaf((*keys, "wq_b"), f"{a}q_b_proj.weight", True)]
    else:
        out.append(leaf((*keys, "wq"), f"{a}q_proj.weight", True))
    out += [leaf((*keys, "wkv_a"), f"{a}kv_a_proj_with_mqa.weight", True),
            leaf((*keys, "kv_a_norm", "scale"), f"{a}kv_a_layernorm.weight", False),
            leaf((*keys, "wkv_b"), f"{a}kv_b_proj.weight", True),
            leaf((*keys, "wo"), f"{a}o_proj.weight", True)]
    if dense:
        return out + [leaf((*keys, w), f"{m}{n}.weight", True) for w, n in _MLP]
    out.append(leaf((*keys, "router"), f"{m}gate.weight", True))
    if cfg.router_score == "sigmoid":  # V3's correction bias
        out.append(leaf((*keys, "router_bias"), f"{m}gate.e_score_correction_bias", False))
    out += [leaf((*keys, w), f"{m}experts.{{e}}.{n}.weight", True) for w, n in _MLP]
    if cfg.n_shared_experts:
        out += [leaf((*keys, w.replace("w_", "shared_")), f"{m}shared_experts.{n}.weight", True)
                for w, n in _MLP]
    return out


def _table(cfg) -> tuple[Leaf, ...]:
    k = cfg.first_k_dense
    return (Leaf(("embed",), "model.embed_tokens.weight", False),
            *(_stack("dense_blocks", 0, True, cfg) if k else []),
            *_stack("blocks", k, False, cfg),
            Leaf(("ln_f", "scale"), "model.norm.weight", False),
            Leaf(("head",), "lm_head.weight", True))


# config.json key -> (model field, kind)
_KEYS = {"n_routed_experts": ("n_experts", int), "num_experts_per_tok": ("experts_per_token", int),
         "moe_intermediate_size": ("moe_d_ff", int), "n_shared_experts": ("n_shared_experts", int),
         "norm_topk_prob": ("router_renormalize", bool), "n_group": ("router_groups", int),
         "topk_group": ("router_topk_groups", int),
         "routed_scaling_factor": ("routed_scaling_factor", float),
         "first_k_dense_replace": ("first_k_dense", int), "kv_lora_rank": ("kv_lora_rank", int),
         "qk_nope_head_dim": ("qk_nope_head_dim", int),
         "qk_rope_head_dim": ("qk_rope_head_dim", int), "v_head_dim": ("v_head_dim", int),
         "rope_interleave": ("rope_interleave", bool)}


def _options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    out = {field: number(hf, key, kind, source=source) for key, (field, kind) in _KEYS.items()}
    return {**out, "router_score": "sigmoid",
            "q_lora_rank": number(hf, "q_lora_rank", int, source=source, none=True)}


def _mtp_layer(cfg, name: str) -> bool:
    """A multi-token-prediction layer's tensor (``model.layers.{n_layers + d}.*``): DeepSeek's
    checkpoints hold ``num_nextn_predict_layers`` of them; transformers' model reads none."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= cfg.n_layers)


def _to_hf(cfg) -> dict[str, Any]:
    if not cfg.kv_lora_rank:
        raise ConfigError("DeepseekV3ForCausalLM has latent attention (model.kv_lora_rank > 0); "
                          "the run has model.kv_lora_rank 0")
    out = {key: getattr(cfg, field) for key, (field, _) in _KEYS.items()}
    return {**out, "moe_intermediate_size": cfg.expert_ff, "q_lora_rank": cfg.q_lora_rank,
            "head_dim": cfg.qk_rope_head_dim}


DEEPSEEK_V3 = family_layout(Family(
    architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
    fixed={"attention_bias": (False, None), "pretraining_tp": (1, None),
           "scoring_func": ("sigmoid", None), "topk_method": ("noaux_tc", None)},
    mapped=(*_KEYS, "q_lora_rank"),
    # DeepSeek's deployment and training hints: transformers' model reads none of them; the
    # auto_map of DeepSeek-V3's and Kimi K2's hub configs names DeepSeek's own modelling code,
    # which transformers' DeepseekV3 ports
    inert=("ep_size", "moe_layer_freq", "num_nextn_predict_layers", "aux_loss_alpha",
           "seq_aux", "auto_map"),
    options=_options, to_hf=_to_hf, unread=lambda cfg, name: _mtp_layer(cfg, name),
    model={"router_score": "sigmoid", **{field: ANY for field in (
        "n_experts", "experts_per_token", "n_shared_experts", "moe_d_ff", "router_renormalize",
        "router_groups", "router_topk_groups", "routed_scaling_factor", "first_k_dense",
        "kv_lora_rank")}},
    table=_table))


# DeepSeek-V2 (and V2-Lite): V3's tensors without the correction bias, a softmax router
# (``greedy``, or ``group_limited_greedy`` over ``n_group`` groups scored by their best),
# the kept probabilities times ``routed_scaling_factor`` and not renormalised (transformers'
# gate reads no ``norm_topk_prob``: only false, as both released models have, is read);
# rotary on interleaved pairs (complex ``freqs_cis``: V3's ``rope_interleave``)
_V2_KEYS = {k: v for k, v in _KEYS.items() if k not in (
    "norm_topk_prob", "n_group", "topk_group", "rope_interleave")}


def _v2_options(hf: dict[str, Any], source: str) -> dict[str, Any]:
    out = {field: number(hf, key, kind, source=source) for key, (field, kind) in _V2_KEYS.items()
           if key != "n_shared_experts"}
    # null: no shared experts (transformers' DeepseekV2MoE and DeepSeek's own code build them
    # only where it is not None); an absent key is the class default, 2 (zjax.hf._defaults)
    out["n_shared_experts"] = number(hf, "n_shared_experts", int, source=source,
                                     none=True) or 0
    method = hf.get("topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise CheckpointError(f"{source}: topk_method = {method!r}; DeepseekV2ForCausalLM "
                              "routes by 'greedy' or 'group_limited_greedy'")
    grouped = method == "group_limited_greedy"
    return {**out, "router_renormalize": False, "rope_interleave": True,
            "q_lora_rank": number(hf, "q_lora_rank", int, source=source, none=True),
            "router_groups": number(hf, "n_group", int, source=source) if grouped else 1,
            "router_topk_groups": number(hf, "topk_group", int, source=source) if grouped else 1}


def _v2_to_hf(cfg) -> dict[str, Any]:
    if not cfg.kv_lora_rank:
        raise ConfigError("DeepseekV2ForCausalLM has latent attention (model.kv_lora_rank > 0); "
                          "the run has model.kv_lora_rank 0")
    out = {key: getattr(cfg, field) for key, (field, _) in _V2_KEYS.items()}
    grouped = cfg.router_groups > 1
    return {**out, "moe_intermediate_size": cfg.expert_ff, "q_lora_rank": cfg.q_lora_rank,
            "head_dim": cfg.qk_rope_head_dim, "norm_topk_prob": False,
            "topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": cfg.router_groups if grouped else None,
            "topk_group": cfg.router_topk_groups if grouped else None}


DEEPSEEK_V2 = family_layout(Family(
    architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2",
    fixed={"attention_bias": (False, None), "mlp_bias": (False, None),
           "norm_topk_prob": (False, None), "scoring_func": ("softmax", None)},
    mapped=(*_V2_KEYS, "q_lora_rank", "topk_method", "n_group", "topk_group"),
    inert=("ep_size", "moe_layer_freq", "aux_loss_alpha", "seq_aux"),
    options=_v2_options, to_hf=_v2_to_hf,
    model={"router_renormalize": False, "rope_interleave": True, **{field: ANY for field in (
        "n_experts", "experts_per_token", "n_shared_experts", "moe_d_ff", "router_groups",
        "router_topk_groups", "routed_scaling_factor", "first_k_dense", "kv_lora_rank")}},
    table=_table))
