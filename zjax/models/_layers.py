"""Pieces the reference models share: logical-axis params, RMSNorm, the causal mask and the
key/value cache of decoding."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zjax.errors import ArgumentError

__all__ = ["KVCache", "LayerNorm", "RMSNorm", "causal_mask", "check_length", "param", "zeros"]


def param(rngs: nnx.Rngs, shape, std: float, axes: tuple[str | None, ...]) -> nnx.Param:
    """A normal(0, std) float32 weight naming its dimensions (Flax's logical axes)."""
    # logical axis names only: zjax places the weights, so Flax must not shard them eagerly
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32),
                     out_sharding=axes, eager_sharding=False)


def zeros(shape, axes: tuple[str | None, ...]) -> nnx.Param:
    """A float32 zero weight (a bias) naming its dimensions."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=axes, eager_sharding=False)


class LayerNorm(nnx.Module):
    """Layer normalisation with a learned scale and bias (GPT-2's); statistics in float32."""

    def __init__(self, d: int, eps: float = 1e-5):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), out_sharding=("embed",),
                               eager_sharding=False)
        self.bias = zeros((d,), ("embed",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True)
                                    + self.eps)
        return (y * self.scale[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation with a learned scale; statistics in float32.

    ``axis``: the scale's logical axis name (``embed`` for the residual stream; None for a
    head's width, which no rule splits). ``plus_one``: scale by ``1 + scale`` (Gemma's), the
    stored scale starting at 0."""

    def __init__(self, d: int, eps: float = 1e-6, *, axis: str | None = "embed",
                 plus_one: bool = False):
        self.eps, self.plus_one = eps, plus_one
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((d,), jnp.float32), out_sharding=(axis,),
                               eager_sharding=False)

    def __call__(self, x, scale: jax.Array | None = None):
        """``x`` normalised over its last axis, times ``scale`` (default: the learned one;
        a caller in a tensor-parallel region passes it marked there)."""
        scale = self.scale[...] if scale is None else scale
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = scale.astype(jnp.float32)
        return (y * (1 + scale if self.plus_one else scale)).astype(x.dtype)


def check_length(tokens: jax.Array, max_seq_len: int) -> int:
    """The sequence length of ``tokens`` ``[B, T]``, refused above ``max_seq_len``."""
    t = tokens.shape[1]
    if t > max_seq_len:
        raise ArgumentError("tokens", f"a sequence of {t} tokens exceeds the model's "
                            f"max_seq_len {max_seq_len}")
    return t


def causal_mask(t: int, s: int, start=0) -> jax.Array:
    """``[t, s]``: query ``i`` (at position ``start + i``) sees keys ``0..start + i``."""
    return (start + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]


class KVCache(NamedTuple):
    """Keys and values of the positions decoded so far, ``[B, S, heads, head_dim]`` per layer
    (a leading layer axis for a ``Stack``'s; ``Stack.decode`` scans over it)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, n_layers: int, batch: int, length: int, heads: int, head_dim: int,
              dtype=jnp.float32) -> KVCache:
        shape = (n_layers, batch, length, heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, k: jax.Array, v: jax.Array, start) -> KVCache:
        """This layer's cache with ``k``, ``v`` ``[B, T, ...]`` written at ``start``."""
        put = lambda old, new: jax.lax.dynamic_update_slice_in_dim(
            old, new.astype(old.dtype), start, axis=1)
        return KVCache(put(self.k, k), put(self.v, v))
