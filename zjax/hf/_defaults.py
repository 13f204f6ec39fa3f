"""What transformers reads for a ``config.json`` key that is left out: its configuration
class's default, family by family.

``from_pretrained`` builds the config as ``ConfigClass(**config.json)``, so an absent key takes
the ``__init__`` default of that family's class, and the defaults differ between families (a
Mistral without ``sliding_window`` has a 4096-token window, a Gemma 2 without
``attn_logit_softcapping`` caps at 50). :data:`DEFAULTS` holds, for every key zjax's mapping
reads, the default of transformers 4.57's class (``configuration_<family>.py``, the
signature's value; tests/test_reliability_hf.py reads the classes and checks each). zjax
reads a config as ``{**DEFAULTS[model_type], **config.json}``.

A default of None is transformers' "derived" (``num_key_value_heads``: the query heads;
``head_dim``: ``hidden_size // num_attention_heads``), which zjax's mapping derives the same
way. A key a family's class does not take (Qwen2's ``head_dim``, Mistral's ``rope_scaling``)
is not in its table: transformers' modelling file falls back to the derived value or to none,
as zjax does. Note the fixed head widths: Qwen3 defaults ``head_dim`` to 128 and the Gemmas
to 256, not to ``hidden_size // num_attention_heads``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "TRANSFORMERS_VERSION", "absent", "with_defaults"]

TRANSFORMERS_VERSION = "4.57"

# the keys every Llama-family class shares, at LlamaConfig's defaults
_LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
          "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
          "attention_dropout": 0.0, "head_dim": None}
_QWEN = {**_LLAMA, "vocab_size": 151936, "intermediate_size": 22016,
         "num_key_value_heads": 32, "max_position_embeddings": 32768,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
         "layer_types": None}
_GEMMA = {**_LLAMA, "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
          "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
          "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": None,
          "max_position_embeddings": 8192, "tie_word_embeddings": True,
          "attention_bias": False}
_GEMMA2 = {**{k: v for k, v in _GEMMA.items() if k != "hidden_act"},
           "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
           "num_attention_heads": 8, "num_key_value_heads": 4,
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
           "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": 30.0,
           "attn_logit_softcapping": 50.0}
_MISTRAL = {**{k: v for k, v in _LLAMA.items() if k != "rope_scaling"},
            "intermediate_size": 14336, "num_key_value_heads": 8,
            "max_position_embeddings": 131072, "sliding_window": 4096}

# model_type -> {config.json key: transformers 4.57's class default}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA, "pretraining_tp": 1, "attention_bias": False, "mlp_bias": False},
    "mistral": _MISTRAL,
    "mixtral": {**_MISTRAL, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
                "output_router_logits": False, "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0},
    "qwen2": {k: v for k, v in _QWEN.items() if k != "head_dim"},
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "qwen3_moe": {**{k: v for k, v in _QWEN.items()
                     if k not in ("head_dim", "max_window_layers", "layer_types")},
                  "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_key_value_heads": 4, "attention_bias": False,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
                  "output_router_logits": False, "router_aux_loss_coef": 0.001,
                  "mlp_only_layers": None},
    # DeepseekV3Config: head_dim is not an argument (it is set to qk_rope_head_dim)
    "deepseek_v3": {**{k: v for k, v in _LLAMA.items() if k != "head_dim"},
                    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128,
                    "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 4096, "pretraining_tp": 1,
                    "rope_interleave": True, "attention_bias": False},
    "deepseek_v2": {**{k: v for k, v in _LLAMA.items() if k != "head_dim"},
                    "attention_bias": False, "mlp_bias": False, "first_k_dense_replace": 0,
                    "kv_lora_rank": 512, "q_lora_rank": 1536, "n_group": None,
                    "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None,
                    "topk_method": "greedy", "v_head_dim": 128, "num_experts_per_tok": None,
                    "norm_topk_prob": False, "moe_intermediate_size": 1407,
                    "aux_loss_alpha": 0.001, "seq_aux": True},
    "phi3": {**{k: v for k, v in _LLAMA.items() if k != "head_dim"},
             "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "partial_rotary_factor": 1.0, "sliding_window": None},
    "gemma": {k: v for k, v in _GEMMA.items() if k != "rope_scaling"},
    "gemma2": {k: v for k, v in _GEMMA2.items() if k != "rope_scaling"},
    "gemma3_text": {**_GEMMA2, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "rope_theta": 1000000.0, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "rope_local_base_freq": 10000.0,
                    "use_bidirectional_attention": False},
    # GPT2Config, and PretrainedConfig's for the two keys it leaves to its base class
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
             "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True,
             "add_cross_attention": False},
}


def absent(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The keys ``hf`` leaves out that zjax reads, each with transformers' default."""
    return {k: v for k, v in DEFAULTS.get(model_type, {}).items() if k not in hf}


def with_defaults(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``hf`` with every key it leaves out at transformers' default for ``model_type`` (an
    explicit value, null included, is kept)."""
    return {**DEFAULTS.get(model_type, {}), **hf}
