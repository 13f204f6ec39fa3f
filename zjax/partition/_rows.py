"""A tensor's tiles as rows, one per device, and back: the layout of buckets and of the
quantized collectives."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["from_rows", "to_rows"]


def to_rows(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``x`` split along ``dim`` into ``n`` tiles, one row each: ``(n, x.size // n)``."""
    tiles = x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1:])
    return jnp.moveaxis(tiles, dim, 0).reshape(n, -1)


def from_rows(rows: jax.Array, shard_shape: tuple[int, ...], dim: int) -> jax.Array:
    """Inverse of :func:`to_rows`: ``(n, shard size)`` rows -> the tiles joined on ``dim``."""
    n = rows.shape[0]
    tiles = jnp.moveaxis(rows.reshape(n, *shard_shape), 0, dim)
    return tiles.reshape(*shard_shape[:dim], n * shard_shape[dim], *shard_shape[dim + 1:])
