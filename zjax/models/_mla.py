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

Decoding caches the latent, not the heads (:func:`mla_decode`): per position the normalised
``kv_lora_rank`` latent and the rotated shared key part (DeepSeek-V3: 576 numbers where the
heads' keys and values are 40960), and attends in the latent space: the queries' non-rotary
part through ``kv_b_proj``'s key half, the weighted latents out through its value half (the
"absorbed" form of DeepSeek's inference code: the same sums in another order).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zjax.models._layers import KVCache, RMSNorm, param
from zjax.models._rope import rotary
from zjax.models.config import LlamaConfig

__all__ = ["MLA", "init_mla", "mla_cache", "mla_decode", "mla_qkv"]


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
    q = _queries(block, y, drop)
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


def mla_cache(n_layers: int, batch: int, length: int, m: MLA, dtype) -> KVCache:
    """An empty latent cache: ``k`` ``[L, B, S, 1, kv_lora_rank + qk_rope]`` (the latent, then
    the rotated shared key part); ``v`` a placeholder one wide."""
    return KVCache(jnp.zeros((n_layers, batch, length, 1, m.kv_rank + m.rope), dtype),
                   jnp.zeros((n_layers, batch, length, 1, 1), dtype))


def _queries(block, y, drop):
    m: MLA = block.mla
    if hasattr(block, "wq_a"):
        q = block._linear(block.q_a_norm(block._linear(y, "wq_a", drop=drop)), "wq_b",
                          drop=drop)
    else:
        q = block._linear(y, "wq", drop=drop)
    return q.reshape(*y.shape[:2], m.heads, m.nope + m.rope)


def mla_decode(block, y: jax.Array, cache: KVCache, start, rope: tuple, positions,
               pads=None) -> tuple[jax.Array, KVCache]:
    """Attention of ``y`` ``[B, T, D]`` at cache indices ``start``.. over the latent cache:
    ``([B, T, H * v_head_dim], cache with these positions written)``."""
    m: MLA = block.mla
    b, t, _ = y.shape
    q = _queries(block, y, None)
    kv = block._linear(y, "wkv_a")
    latent = block.kv_a_norm(kv[..., :m.kv_rank])
    k_rot, q_rot = kv[..., m.kv_rank:].reshape(b, t, 1, m.rope), q[..., m.nope:]
    if m.interleave:
        q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
    q_rot, k_rot = (rotary(x, rope[0], start, rope[1], positions) for x in (q_rot, k_rot))
    cache = cache.write(jnp.concatenate([latent[:, :, None], k_rot], -1),
                        jnp.zeros((b, t, 1, 1), cache.v.dtype), start)
    c, r = cache.k[:, :, 0, :m.kv_rank], cache.k[:, :, 0, m.kv_rank:]  # [B, S, ...]
    w = block._weight("wkv_b", dtype=jnp.float32).astype(jnp.float32).reshape(
        m.kv_rank, m.heads, m.nope + m.v)  # with its adapters merged
    f32 = lambda a: a.astype(jnp.float32)
    q_lat = jnp.einsum("bthn,rhn->bthr", f32(q[..., :m.nope]), w[..., :m.nope])
    scores = (jnp.einsum("bthr,bsr->bhts", q_lat, f32(c))
              + jnp.einsum("bthd,bsd->bhts", f32(q_rot), f32(r))) * m.scale
    s = jnp.arange(c.shape[1])
    seen = s[None, :] <= (start + jnp.arange(t))[:, None]  # [T, S]: causal over the cache
    if pads is not None:  # left padding is no one's key
        seen = seen[None] & (s[None, None, :] >= pads[:, None, None])
    seen = seen if seen.ndim == 3 else seen[None]
    # a padding query sees no key: a finite average, as the other attention paths give it
    p = jax.nn.softmax(jnp.where(seen[:, None], scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bhts,bsr->bthr", p, f32(c))
    out = jnp.einsum("bthr,rhv->bthv", out, w[..., m.nope:])
    return out.reshape(b, t, m.heads * m.v).astype(y.dtype), cache
