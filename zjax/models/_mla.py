"""DeepSeek's multi-head latent attention (MLA), as transformers 4.57's ``DeepseekV3Attention``
computes it, for the Llama block (``model.kv_lora_rank`` > 0).

Keys and values come up from one normalised ``kv_lora_rank``-wide latent per token
(``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``); each key is a
``qk_nope_head_dim`` part from the latent and a ``qk_rope_head_dim`` rotary part shared by the
heads (the rest of ``kv_a_proj_with_mqa``'s output); queries the same two parts, through their
own normalised latent where ``q_lora_rank`` is set. The rotary parts are de-interleaved first
where ``rope_interleave`` (transformers' ``apply_rotary_pos_emb_interleave``). Values are
``v_head_dim`` wide, padded with zeros to the query/key width so that every attention kernel
(fused, blockwise, context-parallel) takes them unchanged; the padding is cut from the output.
The softmax scale is ``(qk_nope + qk_rope)^-1/2``, times ``mscale(factor, mscale_all_dim)^2``
under YaRN, as DeepSeek's code and transformers' V3 apply it.

Weights (``[in, out]``): ``wq`` or ``wq_a`` / ``q_a_norm`` / ``wq_b``, ``wkv_a``, ``kv_a_norm``,
``wkv_b``, ``wo``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zjax.models._layers import RMSNorm, param
from zjax.models._rope import rotary
from zjax.models.config import LlamaConfig

__all__ = ["MLA", "init_mla", "mla_qkv"]


class MLA(NamedTuple):
    """The widths latent attention reads of the ``model`` section."""

    heads: int
    nope: int
    rope: int
    v: int
    kv_rank: int
    interleave: bool
    scale: float

    @classmethod
    def of(cls, cfg: LlamaConfig) -> MLA:
        scale = cfg.head_width ** -0.5
        if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim and cfg.rope_factor > 1:
            m = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0
            scale *= m * m
        return cls(cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.kv_lora_rank, cfg.rope_interleave, scale)


def init_mla(block, cfg: LlamaConfig, rngs, out_std: float) -> MLA:
    """The block's latent-attention weights; returns its widths."""
    d, h, qk = cfg.d_model, cfg.n_heads, cfg.head_width
    if cfg.q_lora_rank:
        block.wq_a = param(rngs, (d, cfg.q_lora_rank), 0.02, ("embed", None))
        block.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, axis=None)
        block.wq_b = param(rngs, (cfg.q_lora_rank, h * qk), 0.02, (None, "heads"))
    else:
        block.wq = param(rngs, (d, h * qk), 0.02, ("embed", "heads"))
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    block.wkv_a = param(rngs, (d, rank + rope), 0.02, ("embed", None))
    block.kv_a_norm = RMSNorm(rank, cfg.norm_eps, axis=None)
    block.wkv_b = param(rngs, (rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)), 0.02,
                        (None, "heads"))
    block.wo = param(rngs, (h * cfg.v_head_dim, d), out_std, ("heads", "embed"))
    return MLA.of(cfg)


def _deinterleave(x: jax.Array) -> jax.Array:
    """``[..., d]`` pairs ``(x0, x1), (x2, x3)...`` -> ``x0, x2, ..., x1, x3, ...``."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], -1, 2), -1, -2).reshape(x.shape)


def mla_qkv(block, y: jax.Array, rope: tuple, start, positions, drop=None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries and keys ``[B, T, H, nope + rope]`` (rotary applied) and values padded to that
    width, for normalised ``y`` ``[B, T, D]``."""
    m: MLA = block.mla
    b, t, _ = y.shape
    if hasattr(block, "wq_a"):
        q = block._linear(block.q_a_norm(block._linear(y, "wq_a", drop=drop)), "wq_b",
                          drop=drop)
    else:
        q = block._linear(y, "wq", drop=drop)
    q = q.reshape(b, t, m.heads, m.nope + m.rope)
    kv = block._linear(y, "wkv_a", drop=drop)
    latent, k_rot = kv[..., :m.kv_rank], kv[..., m.kv_rank:].reshape(b, t, 1, m.rope)
    kv = block._linear(block.kv_a_norm(latent), "wkv_b", drop=drop)
    kv = kv.reshape(b, t, m.heads, m.nope + m.v)
    q_rot = q[..., m.nope:]
    if m.interleave:
        q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
    q_rot, k_rot = (rotary(x, rope[0], start, rope[1], positions) for x in (q_rot, k_rot))
    q = jnp.concatenate([q[..., :m.nope], q_rot], axis=-1)
    k = jnp.concatenate([kv[..., :m.nope], jnp.broadcast_to(k_rot, (b, t, m.heads, m.rope))],
                        axis=-1)
    v = jnp.pad(kv[..., m.nope:], ((0, 0), (0, 0), (0, 0), (0, m.nope + m.rope - m.v)))
    return q, k, v
