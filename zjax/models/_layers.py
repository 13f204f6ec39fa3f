"""Pieces the reference models share: logical-axis params and RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zjax.errors import ArgumentError

__all__ = ["RMSNorm", "check_length", "param"]


def param(rngs: nnx.Rngs, shape, std: float, axes: tuple[str | None, ...]) -> nnx.Param:
    """A normal(0, std) float32 weight naming its dimensions (Flax's logical axes)."""
    # logical axis names only: zjax places the weights, so Flax must not shard them eagerly
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32),
                     out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation with a learned scale; statistics in float32."""

    def __init__(self, d: int, eps: float = 1e-6):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), out_sharding=("embed",),
                               eager_sharding=False)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def check_length(tokens: jax.Array, max_seq_len: int) -> int:
    """The sequence length of ``tokens`` ``[B, T]``, refused above ``max_seq_len``."""
    t = tokens.shape[1]
    if t > max_seq_len:
        raise ArgumentError("tokens", f"a sequence of {t} tokens exceeds the model's "
                            f"max_seq_len {max_seq_len}")
    return t
