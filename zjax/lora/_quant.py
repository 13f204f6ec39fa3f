"""A frozen linear weight stored quantized (QLoRA's base): blockwise absmax over blocks of 64
along the input dimension, as bitsandbytes blocks PyTorch's ``[out, in]`` rows.

- ``int8``: ``round(127 * w / absmax)`` per element, one byte each.
- ``nf4``: the index of the nearest NormalFloat4 value (the QLoRA paper's 16 quantiles of a
  normal distribution, bitsandbytes' table) of ``w / absmax``, two per byte.

A weight ``[..., in, out]`` is one ``uint8`` array ``[..., rows, out]``: the codes (``in``
rows for int8, ``in / 2`` for nf4: the even input's code in the high nibble) then the float32
absmax of each block as its four bytes (``4 * in / 64`` rows). One integer leaf per weight:
ZeRO shards, gathers and checkpoints it like any leaf, and a gather moves its bytes (nf4:
0.56 bytes a weight against bfloat16's 2). :func:`dequantize` rebuilds the weight after the
gather.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from zjax.errors import ConfigError

__all__ = ["BLOCK", "KINDS", "NF4", "BaseCodec", "dequantize", "packed_rows", "quantize"]

BLOCK = 64
KINDS = ("int8", "nf4")
# bitsandbytes' NF4 table (QLoRA, Dettmers et al. 2023, appendix E)
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def packed_rows(d_in: int, kind: str) -> int:
    """Rows of the packed array of a weight with ``d_in`` inputs."""
    return (d_in if kind == "int8" else d_in // 2) + 4 * (d_in // BLOCK)


def check_shape(d_in: int, *, what: str) -> None:
    if d_in % BLOCK:
        raise ConfigError(f"lora.base_dtype: {what} has {d_in} inputs, not a multiple of the "
                          f"quantization block ({BLOCK}); use base_dtype bfloat16")


def quantize(w: jax.Array, kind: str) -> jax.Array:
    """``w`` ``[..., in, out]`` (float) -> packed ``uint8`` ``[..., packed_rows(in), out]``."""
    *lead, d_in, d_out = w.shape
    check_shape(d_in, what=f"a weight of shape {tuple(w.shape)}")
    blocks = w.astype(jnp.float32).reshape(*lead, d_in // BLOCK, BLOCK, d_out)
    absmax = jnp.max(jnp.abs(blocks), axis=-2, keepdims=True)
    scaled = blocks / jnp.where(absmax == 0, 1.0, absmax)
    if kind == "int8":
        codes = lax.bitcast_convert_type(
            jnp.round(scaled * 127).astype(jnp.int8), jnp.uint8).reshape(*lead, d_in, d_out)
    else:
        table = jnp.asarray(NF4, jnp.float32)
        idx = jnp.argmin(jnp.abs(scaled[..., None] - table), axis=-1).astype(jnp.uint8)
        pairs = idx.reshape(*lead, d_in // 2, 2, d_out)
        codes = (pairs[..., 0, :] << 4) | pairs[..., 1, :]
    scale_bytes = lax.bitcast_convert_type(absmax[..., 0, :], jnp.uint8)  # [.., nb, out, 4]
    scale_bytes = jnp.swapaxes(scale_bytes, -1, -2).reshape(*lead, 4 * (d_in // BLOCK), d_out)
    return jnp.concatenate([codes, scale_bytes], axis=-2)


def dequantize(packed: jax.Array, kind: str, d_in: int, dtype) -> jax.Array:
    """The weight ``[..., in, out]`` in ``dtype`` of a :func:`quantize` d array."""
    *lead, _, d_out = packed.shape
    n_codes, nb = (d_in if kind == "int8" else d_in // 2), d_in // BLOCK
    codes, scale_bytes = packed[..., :n_codes, :], packed[..., n_codes:, :]
    scale_bytes = jnp.swapaxes(scale_bytes.reshape(*lead, nb, 4, d_out), -1, -2)
    absmax = lax.bitcast_convert_type(scale_bytes, jnp.float32)  # [..., nb, out]
    if kind == "int8":
        values = lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32) / 127
    else:
        idx = jnp.stack([codes >> 4, codes & 15], axis=-2).reshape(*lead, d_in, d_out)
        values = jnp.asarray(NF4, jnp.float32)[idx]
    blocks = values.reshape(*lead, nb, BLOCK, d_out) * absmax[..., None, :]
    return blocks.reshape(*lead, d_in, d_out).astype(dtype)


@dataclasses.dataclass(frozen=True)
class BaseCodec:
    """Which frozen leaves a model stores quantized, and how: the leaves whose last path
    component is in ``names`` (a ``Stack``'s linear weights ``[L, in, out]``), as ``kind``.
    A loader reads them as float weights (:meth:`logical_shape`) and :meth:`encode` s them."""

    kind: str
    names: frozenset

    def encodes(self, path: str) -> bool:
        return path.rsplit("/", 1)[-1] in self.names

    def logical_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The float weight's shape of a packed leaf of ``shape``."""
        *lead, rows, out = shape
        per = (1 if self.kind == "int8" else 0.5) + 4 / BLOCK  # packed rows per input
        return (*lead, round(rows / per), out)

    def encode(self, w: jax.Array) -> jax.Array:
        return quantize(w, self.kind)
