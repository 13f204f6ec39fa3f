"""The Llama block's linear weights: their Hugging Face module names (``lora.targets``, PEFT's
``target_modules``) and logical axes, for every option of the family (a block has some of
them: DeepSeek's latent attention has no ``k_proj``, a dense MLP no shared experts)."""

from __future__ import annotations

from zjax.models._linears import Modules

__all__ = ["EXPERT_AXES", "LINEAR_AXES", "LINEAR_WEIGHTS", "MODULES"]

# Hugging Face's module names of the linear layers (lora.targets), and the block's weights:
# a name covers every weight of that name in the block (DeepSeek's gate_proj: the dense
# MLP's, the routed experts' and the shared experts', as PEFT matches module names)
MODULES: Modules = {
    "q_proj": (("wq",),), "k_proj": (("wk",),), "v_proj": (("wv",),), "o_proj": (("wo",),),
    "gate_proj": (("w_gate",), ("shared_gate",)), "up_proj": (("w_up",), ("shared_up",)),
    "down_proj": (("w_down",), ("shared_down",)),
    # DeepSeek's latent attention (model.kv_lora_rank)
    "q_a_proj": (("wq_a",),), "q_b_proj": (("wq_b",),),
    "kv_a_proj_with_mqa": (("wkv_a",),), "kv_b_proj": (("wkv_b",),)}
LINEAR_AXES = {"wq": ("embed", "heads"), "wk": ("embed", "heads"), "wv": ("embed", "heads"),
               "wo": ("heads", "embed"), "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"),
               "w_down": ("mlp", "embed"), "shared_gate": ("embed", "mlp"),
               "shared_up": ("embed", "mlp"), "shared_down": ("mlp", "embed"),
               "wq_a": ("embed", None), "wq_b": (None, "heads"), "wkv_a": ("embed", None),
               "wkv_b": (None, "heads")}
LINEAR_WEIGHTS = tuple(LINEAR_AXES)
EXPERT_AXES = {"w_gate": ("expert", "embed", "mlp"), "w_up": ("expert", "embed", "mlp"),
               "w_down": ("expert", "mlp", "embed")}
