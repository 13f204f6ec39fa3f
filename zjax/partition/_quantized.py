"""ZeRO++'s quantized collectives: blockwise int8 with a float32 or bfloat16 scale per block
(symmetric, absmax / 127). The int8 values and the scales move as unsigned bits: XLA would
otherwise move the dequantizing convert in front of the collective and send floats."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zjax.partition._rows import from_rows, to_rows

__all__ = ["dequantize_rows", "gather_rows", "quantize_shard", "quantized_all_gather",
           "quantized_reduce_scatter"]


def _quantize(rows: jax.Array, block: int, scale_dtype=jnp.float32
              ) -> tuple[jax.Array, jax.Array]:
    """Rows ``(n, m)`` -> int8 blocks ``(n, m / block, block)`` (zero-padded) and their
    scales ``(n, m / block)`` in ``scale_dtype`` (absmax / 127, symmetric). A 16-bit scale is
    rounded up (never below the absmax's): the largest element still fits in 127 steps."""
    n, m = rows.shape
    blocks = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, -m % block))).reshape(n, -1, block)
    scale = jnp.max(jnp.abs(blocks), axis=2) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    if jnp.dtype(scale_dtype) != jnp.float32:
        narrow = scale.astype(scale_dtype)
        up = jnp.nextafter(narrow, jnp.asarray(jnp.inf, scale_dtype))
        scale = jnp.where(narrow.astype(jnp.float32) < scale, up, narrow)
    q = jnp.clip(jnp.round(blocks / scale.astype(jnp.float32)[..., None]), -127, 127)
    return q.astype(jnp.int8), scale


def _bits(scale: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(scale, {2: jnp.uint16, 4: jnp.uint32}[scale.dtype.itemsize])


def quantize_shard(x: jax.Array, block: int, scale_dtype=jnp.float32
                   ) -> tuple[jax.Array, jax.Array]:
    """A shard as one row of int8 blocks (moved as uint8 bits) and its scales:
    ``(1, blocks, block)`` and ``(1, blocks)``, the input of :func:`gather_rows`."""
    flat = x.reshape(-1)
    # a small shard is one block, not a padded one
    q, scale = _quantize(flat[None], min(block, flat.size), scale_dtype)
    # as bits: XLA would otherwise move the int8 -> float convert in front of the gather
    return lax.bitcast_convert_type(q, jnp.uint8), _bits(scale)


def gather_rows(parts: tuple[jax.Array, jax.Array], axis_name: str,
                tag=lambda v: v) -> tuple[jax.Array, jax.Array]:
    """All-gather quantized rows over ``axis_name``: ``r`` rows per device become ``n * r``,
    this axis's index major (the order of a PartitionSpec naming it first)."""
    def one(v):
        rows = tag(lax.all_gather(v, axis_name, axis=0, tiled=False))
        return rows.reshape(-1, *v.shape[1:])
    return one(parts[0]), one(parts[1])


def dequantize_rows(parts: tuple[jax.Array, jax.Array], shard_shape, axis: int, dtype,
                    tag=lambda v: v, scale_dtype=jnp.float32) -> jax.Array:
    """Every device's quantized shard (rows in shard order) as the gathered tensor."""
    bits, scale = parts
    scale = lax.bitcast_convert_type(scale, scale_dtype)
    q_rows = tag(lax.bitcast_convert_type(bits, jnp.int8))  # (n, blocks, block)
    n, size = q_rows.shape[0], int(np.prod(shard_shape, dtype=np.int64))
    rows = (q_rows.astype(jnp.float32) * scale.astype(jnp.float32)[..., None])
    rows = rows.reshape(n, -1)[:, :size]
    return tag(from_rows(rows.astype(dtype), shard_shape, axis))


def quantized_all_gather(x: jax.Array, axis_name: str, *, axis: int, block: int, dtype,
                         name: str | None = None, scale_dtype=jnp.float32) -> jax.Array:
    """Tiled all-gather of ``x`` as blockwise int8 (ZeRO++'s qwZ), dequantized to ``dtype``.

    The shard is flattened into blocks of ``block`` elements (the last one zero-padded); each
    block moves as int8 with a scale in ``scale_dtype`` (its absmax / 127, symmetric rounding),
    so the gather carries about 1 byte per element plus ``4 / block`` (``2 / block`` with a
    16-bit scale). Rows of the devices' blocks are dequantized and laid back along ``axis``.
    ``name`` tags what the remat policy must not save (the gathered int8 rows, scales and the
    dequantized weight: the backward re-gathers).
    """
    tag = (lambda v: checkpoint_name(v, name)) if name else (lambda v: v)
    parts = gather_rows(quantize_shard(x, block, scale_dtype), axis_name, tag)
    return dequantize_rows(parts, x.shape, axis, dtype, tag, scale_dtype)


def quantized_reduce_scatter(x: jax.Array, axis_name: str, *, dim: int, block: int,
                             scale_dtype=jnp.float32) -> jax.Array:
    """ZeRO++'s qgZ: :func:`zjax.partition.gather.reduce_scatter`'s ``quantized`` method."""
    n = lax.axis_size(axis_name)
    rows = to_rows(x, dim, n)  # row j: this device's contribution to device j's tile
    m = rows.shape[1]
    q, scale = _quantize(rows, min(block, m), scale_dtype)
    bits = lax.all_to_all(lax.bitcast_convert_type(q, jnp.uint8), axis_name, 0, 0,
                          tiled=True)
    scales = lax.bitcast_convert_type(
        lax.all_to_all(_bits(scale), axis_name, 0, 0, tiled=True), scale_dtype)
    got = lax.bitcast_convert_type(bits, jnp.int8).astype(jnp.float32) \
        * scales.astype(jnp.float32)[..., None]
    mine = got.reshape(n, -1)[:, :m].sum(axis=0)  # the n contributions to this device's tile
    shard_shape = (*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1:])
    return mine.reshape(shard_shape).astype(x.dtype)
