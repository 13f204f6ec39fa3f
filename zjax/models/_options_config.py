"""The Llama ``model`` section's checks of DeepSeek's and Phi-3's options (latent attention,
grouped routing, longrope's factors), each naming the key; importing nothing heavy."""

from __future__ import annotations

from zjax.errors import ConfigError

__all__ = ["check_groups", "check_longrope", "check_mla", "check_mtp"]


def check_longrope(cfg) -> None:
    """longrope's factor lists: one positive number per rotary frequency (stored as tuples)."""
    for key in ("rope_short_factor", "rope_long_factor"):
        value = getattr(cfg, key)
        if value is None and cfg.rope_scaling != "longrope":
            continue
        half = cfg.head_width // 2
        if not isinstance(value, list | tuple) or len(value) != half or not all(
                isinstance(v, int | float) and v > 0 for v in value):
            raise ConfigError(f"model.{key}: expected {half} positive numbers (one per "
                              f"rotary frequency) for longrope; got {str(value)[:60]}")
        object.__setattr__(cfg, key, tuple(float(v) for v in value))  # hashable


def check_mla(cfg) -> None:
    """Latent attention takes none of standard attention's options; its widths fit."""
    if not cfg.kv_lora_rank:
        return
    for key in ("qkv_bias", "qk_norm", "global_every", "sliding_window"):
        if getattr(cfg, key):
            raise ConfigError(f"model.{key}: {getattr(cfg, key)} is an option of standard "
                              f"attention; with model.kv_lora_rank {cfg.kv_lora_rank} "
                              "(latent attention) leave it unset")
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim: {cfg.qk_rope_head_dim} is odd; "
                          "rotary embeddings rotate pairs")
    if cfg.v_head_dim > cfg.head_width:
        raise ConfigError(f"model.v_head_dim: {cfg.v_head_dim} exceeds the query/key "
                          f"heads' {cfg.head_width} (qk_nope_head_dim + qk_rope_head_dim)")


def check_groups(cfg) -> None:
    """Expert groups divide the experts; the chosen groups hold the experts a token takes."""
    groups, top = cfg.router_groups, cfg.router_topk_groups
    least = 2 if cfg.router_score == "sigmoid" else 1  # V3 scores a group's best two
    if groups > 1 and (cfg.n_experts % groups or cfg.n_experts // groups < least):
        raise ConfigError(f"model.router_groups: {groups} must divide model.n_experts "
                          f"{cfg.n_experts} into groups of at least {least}")
    if top > groups:
        raise ConfigError(f"model.router_topk_groups: {top} exceeds model.router_groups "
                          f"{groups}")
    if cfg.experts_per_token > top * (cfg.n_experts // groups):
        raise ConfigError(f"model.experts_per_token: {cfg.experts_per_token} exceeds the "
                          f"{top * (cfg.n_experts // groups)} experts of "
                          f"model.router_topk_groups {top} groups")


def check_mtp(cfg) -> None:
    """Multi-token prediction: one depth (DeepSeek-V3's), standard positions."""
    if cfg.mtp_layers > 1:
        raise ConfigError(f"model.mtp_layers: {cfg.mtp_layers} prediction depths; zjax builds "
                          "one (DeepSeek-V3's num_nextn_predict_layers: 1)")
