"""Which ``model`` keys an imported model pins, and which are the run's.

A run that starts from Hugging Face weights (``train.init_from``: an ``import-hf`` directory
or the Hub directory itself) must build the model the weights are: a key that sizes a tensor
or changes the function the weights compute is pinned to the value ``config.json`` gives, and
a run that sets another is refused, naming the key and why. Every other key is the user's: it
chooses how the same function is computed (kernels, chunking, recomputation), bounds the data,
or weighs a training loss. Each table covers every field of its model config (a test checks
it), so a new field is pinned or free by decision, never by omission.
"""

from __future__ import annotations

__all__ = ["GPT2_FREE", "GPT2_PINNED", "LLAMA_FREE", "LLAMA_PINNED"]

_SHAPE = "it sizes the weights"
_HEADS = "it sizes the attention's weights"
_ROPE = "it sets the rotary positions the weights were trained to read"
_FUNCTION = "it changes the function the weights compute"
_EXPERTS = "it sets the experts and their routing the weights were trained with"

# LlamaConfig fields -> why an import pins them
LLAMA_PINNED = {
    "vocab_size": _SHAPE, "d_model": _SHAPE, "n_layers": _SHAPE, "d_ff": _SHAPE,
    "n_heads": _HEADS, "n_kv_heads": _HEADS, "head_dim": _HEADS,
    "qkv_bias": "it adds the query, key and value bias tensors",
    "qk_norm": "it adds the query and key head-norm tensors",
    "post_norms": "it adds the sublayers' output-norm tensors",
    "tie_embeddings": "it decides whether the head is a tensor of its own",
    "sliding_window": "it sets the positions the weights were trained to attend to",
    "global_every": "it sets the positions the weights were trained to attend to",
    "rope_theta": _ROPE, "local_rope_theta": _ROPE, "rope_scaling": _ROPE,
    "rope_factor": _ROPE, "rope_low_freq_factor": _ROPE, "rope_high_freq_factor": _ROPE,
    "rope_original_max_len": _ROPE, "rope_beta_fast": _ROPE, "rope_beta_slow": _ROPE,
    "rope_mscale": _ROPE, "rope_mscale_all_dim": _ROPE, "rope_attention_factor": _ROPE,
    "rope_truncate": _ROPE,
    "attn_softcap": _FUNCTION, "final_softcap": _FUNCTION, "query_pre_attn_scalar": _FUNCTION,
    "mlp_activation": _FUNCTION, "norm_plus_one": _FUNCTION, "embed_scale": _FUNCTION,
    "norm_eps": _FUNCTION,
    "n_experts": _EXPERTS, "experts_per_token": _EXPERTS, "n_shared_experts": _EXPERTS,
    "moe_d_ff": _EXPERTS, "router_renormalize": _EXPERTS, "router_score": _EXPERTS,
    "router_groups": _EXPERTS, "router_topk_groups": _EXPERTS,
    "routed_scaling_factor": _EXPERTS, "first_k_dense": _EXPERTS,
    "kv_lora_rank": _SHAPE, "q_lora_rank": _SHAPE, "qk_nope_head_dim": _SHAPE,
    "qk_rope_head_dim": _SHAPE, "v_head_dim": _SHAPE, "rope_interleave": _ROPE,
    "rope_short_factor": _ROPE, "rope_long_factor": _ROPE, "mtp_layers": _SHAPE,
}
# the run's: kernels (attention, context_attention, moe_matmul, moe_exchange), memory for compute
# (loss_chunk, mlp_chunk, remat), the matmuls' precision (fp8), the data's bound (max_seq_len:
# rotary has no table), and the mixture's training terms (the losses' weights, the capacity
# that drops tokens in training, the balancing bias's speed)
LLAMA_FREE = ("remat", "max_seq_len", "attention", "context_attention", "loss_chunk",
              "mlp_chunk", "fp8", "moe_matmul", "moe_exchange", "moe_chunks",
              "router_aux_loss_coef", "router_z_loss_coef", "capacity_factor",
              "router_bias_update_speed", "router_seq_aux_loss_coef", "mtp_loss_coef")

# GPTConfig fields (GPT-2's layout) -> why an import pins them
GPT2_PINNED = {
    "vocab_size": _SHAPE, "d_model": _SHAPE, "n_layers": _SHAPE, "d_ff": _SHAPE,
    "n_heads": _HEADS, "max_seq_len": "it sizes the learned position table",
    "tie_embeddings": "it decides whether the head is a tensor of its own",
    "norm": "it chooses the norms' tensors and function", "bias": "it adds the bias tensors",
    "norm_eps": _FUNCTION,
}
GPT2_FREE = ("remat", "attention", "context_attention", "loss_chunk", "mlp_chunk", "fp8")
