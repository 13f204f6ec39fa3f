"""Hugging Face ``LlamaForCausalLM`` <-> zjax's reference Llama: config keys and tensor names.

The tensors are in PyTorch's layout, as on the Hub: ``nn.Linear`` weights are ``[out, in]``
(zjax stores ``[in, out]``: transposed), embeddings and norm weights as they are, and each
layer's tensors are separate (``model.layers.{i}...``) where zjax stacks them on a leading
layer axis (one ``Stack``). The names:

=====================================  ===========================================  =========
zjax leaf                              Hugging Face tensor                          transpose
=====================================  ===========================================  =========
``embed`` [V, D]                       ``model.embed_tokens.weight``                no
``blocks/layers/ln1/scale`` [L, D]     ``model.layers.{i}.input_layernorm.weight``  no
``blocks/layers/wq`` [L, D, H*hd]      ``model.layers.{i}.self_attn.q_proj.weight`` yes
``blocks/layers/wk``, ``wv``, ``wo``   ``...self_attn.k_proj``, ``v_proj``, ``o_proj`` yes
``blocks/layers/ln2/scale``            ``...post_attention_layernorm.weight``       no
``blocks/layers/w_gate``, ``w_up``,    ``...mlp.gate_proj``, ``up_proj``,           yes
``w_down``                             ``down_proj``
``ln_f/scale`` [D]                     ``model.norm.weight``                        no
``head`` [D, V] (untied only)          ``lm_head.weight``                           yes
=====================================  ===========================================  =========

Both use the same rotary convention (``rotate_half``: Hugging Face's conversion of Meta's
weights already permuted q and k for it), so no weight is permuted here.
"""

from __future__ import annotations

from typing import Any

from zjax.errors import CheckpointError
from zjax.hf._layout import Layout, Leaf, check_fixed
from zjax.models import LlamaConfig

__all__ = ["LLAMA", "hf_config", "leaves", "llama_config"]


_L = ("blocks", "layers")
LEAVES = (
    Leaf(("embed",), "model.embed_tokens.weight", False),
    Leaf((*_L, "ln1", "scale"), "model.layers.{i}.input_layernorm.weight", False),
    Leaf((*_L, "wq"), "model.layers.{i}.self_attn.q_proj.weight", True),
    Leaf((*_L, "wk"), "model.layers.{i}.self_attn.k_proj.weight", True),
    Leaf((*_L, "wv"), "model.layers.{i}.self_attn.v_proj.weight", True),
    Leaf((*_L, "wo"), "model.layers.{i}.self_attn.o_proj.weight", True),
    Leaf((*_L, "ln2", "scale"), "model.layers.{i}.post_attention_layernorm.weight", False),
    Leaf((*_L, "w_gate"), "model.layers.{i}.mlp.gate_proj.weight", True),
    Leaf((*_L, "w_up"), "model.layers.{i}.mlp.up_proj.weight", True),
    Leaf((*_L, "w_down"), "model.layers.{i}.mlp.down_proj.weight", True),
    Leaf(("ln_f", "scale"), "model.norm.weight", False),
    Leaf(("head",), "lm_head.weight", True),
)

# config.json keys whose value zjax's Llama has no way to honour: (key, accepted values;
# None: the key left out, which means transformers' default)
_FIXED = {"hidden_act": ("silu", None), "attention_bias": (False, None), "mlp_bias": (False, None),
          "pretraining_tp": (1, None)}


def _rope_scaling(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``model.rope_*`` keys of ``config.json``'s ``rope_scaling`` (None, or Llama 3.1's
    ``llama3``); any other kind is refused."""
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope_scaling = {scaling!r} is not supported by zjax "
                              "(it supports None or rope_type 'llama3', Llama 3.1's)")
    return {"rope_scaling": "llama3", "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_len": int(scaling["original_max_position_embeddings"])}


def llama_config(hf: dict[str, Any], *, source: str, max_seq_len: int | None = None
                 ) -> LlamaConfig:
    """The ``model`` section for a Hugging Face Llama ``config.json`` (as a dict).

    Raises:
      CheckpointError: not a Llama config, or one using a feature zjax's Llama lacks (naming
        the key, its value and what zjax supports).
    """
    check_fixed(hf, _FIXED, source=source)
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hf.get("head_dim") not in (None, d // heads):
            raise CheckpointError(f"{source}: head_dim = {hf['head_dim']} differs from "
                                  f"hidden_size / num_attention_heads = {d // heads}; zjax's "
                                  "Llama supports only that")
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]), d_model=d,
            n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            d_ff=int(hf["intermediate_size"]),
            max_seq_len=int(max_seq_len or hf.get("max_position_embeddings", 2048)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **_rope_scaling(hf, source))
    except KeyError as e:
        raise CheckpointError(f"{source}: no {e.args[0]!r}; a Llama config.json has it") from None
    except ValueError as e:  # LlamaConfig's own check, or a value that is not a number
        raise CheckpointError(f"{source}: {e}") from None


def hf_config(cfg: LlamaConfig, *, dtype: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``cfg`` with weights stored in ``dtype``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling is None else {
            "rope_type": "llama3", "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
    }


def leaves(cfg: LlamaConfig) -> list[Leaf]:
    """The leaves of ``cfg``'s params (no ``head`` when the embeddings are tied)."""
    return [leaf for leaf in LEAVES if not (leaf.keys == ("head",) and cfg.tie_embeddings)]


LLAMA = Layout(architecture="LlamaForCausalLM", model_type="llama", loop="llama",
               from_hf=llama_config, to_hf=hf_config, leaves=leaves,
               free=("remat", "max_seq_len"), ignored=("rotary_emb.inv_freq",))
