"""ZeRO++'s quantized collectives: blockwise int8 with a float32 scale per block (symmetric,
absmax / 127). The int8 values move as uint8 bits: XLA would otherwise move the dequantizing
convert in front of the collective and send floats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zjax.partition._rows import from_rows, to_rows

__all__ = ["quantized_all_gather", "quantized_reduce_scatter"]


def _quantize(rows: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Rows ``(n, m)`` -> int8 blocks ``(n, m / block, block)`` (zero-padded) and their
    float32 scales ``(n, m / block)`` (absmax / 127, symmetric)."""
    n, m = rows.shape
    blocks = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, -m % block))).reshape(n, -1, block)
    scale = jnp.max(jnp.abs(blocks), axis=2) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def quantized_all_gather(x: jax.Array, axis_name: str, *, axis: int, block: int, dtype,
                         name: str | None = None) -> jax.Array:
    """Tiled all-gather of ``x`` as blockwise int8 (ZeRO++'s qwZ), dequantized to ``dtype``.

    The shard is flattened into blocks of ``block`` elements (the last one zero-padded); each
    block moves as int8 with a float32 scale (its absmax / 127, symmetric rounding), so the
    gather carries about 1 byte per element plus ``4 / block``. Rows of the devices' blocks are
    dequantized and laid back along ``axis``. ``name`` tags what the remat policy must not save
    (the gathered int8 rows, scales and the dequantized weight: the backward re-gathers).
    """
    tag = (lambda v: checkpoint_name(v, name)) if name else (lambda v: v)
    flat = x.reshape(-1)
    # a small shard is one block, not a padded one
    q, scale = (v[0] for v in _quantize(flat[None], min(block, flat.size)))
    # as uint8 bits: XLA would otherwise move the int8 -> float convert in front of the gather
    bits = lax.all_gather(lax.bitcast_convert_type(q, jnp.uint8), axis_name, axis=0,
                          tiled=False)
    q_rows = tag(lax.bitcast_convert_type(bits, jnp.int8))  # (n, blocks, block)
    s_rows = tag(lax.all_gather(scale, axis_name, axis=0, tiled=False))  # (n, blocks)
    n = q_rows.shape[0]
    rows = (q_rows.astype(jnp.float32) * s_rows[..., None]).reshape(n, -1)[:, :flat.size]
    return tag(from_rows(rows.astype(dtype), x.shape, axis))


def quantized_reduce_scatter(x: jax.Array, axis_name: str, *, dim: int, block: int
                             ) -> jax.Array:
    """ZeRO++'s qgZ: :func:`zjax.partition.gather.reduce_scatter`'s ``quantized`` method."""
    n = lax.axis_size(axis_name)
    rows = to_rows(x, dim, n)  # row j: this device's contribution to device j's tile
    m = rows.shape[1]
    q, scale = _quantize(rows, min(block, m))
    bits = lax.all_to_all(lax.bitcast_convert_type(q, jnp.uint8), axis_name, 0, 0,
                          tiled=True)
    scales = lax.all_to_all(scale, axis_name, 0, 0, tiled=True)
    got = lax.bitcast_convert_type(bits, jnp.int8).astype(jnp.float32) * scales[..., None]
    mine = got.reshape(n, -1)[:, :m].sum(axis=0)  # the n contributions to this device's tile
    shard_shape = (*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1:])
    return mine.reshape(shard_shape).astype(x.dtype)
