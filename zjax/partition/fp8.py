"""FP8 scaling shared by the FP8 matmuls (:mod:`zjax.nn.fp8`) and ``zero.fp8_gather``'s
gathers: a tensor in ``float8_e4m3fn`` or ``float8_e5m2`` scaled by its current absolute
maximum over the whole tensor (torchao's and Transformer Engine's current scaling).

Inside a zjax step the model runs on each device's slice (``shard_map``): the maximum is
taken over every bound mesh axis (:func:`global_amax`), so a sharded run scales exactly as
one device running the whole batch does, and a gathered weight's scale is the whole
weight's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.runtime.mesh import CONTEXT, DATA, EXPERT, MODEL, NODE, REPLICA

__all__ = ["E4M3", "E5M2", "Fp8Weight", "Scaled", "as_operand", "dequantized", "global_amax",
           "quantize", "weight_grad"]

E4M3 = jnp.float8_e4m3fn  # inputs and weights: more precision
E5M2 = jnp.float8_e5m2  # gradients: more range
_AXES = (REPLICA, NODE, DATA, EXPERT, CONTEXT, MODEL)
_SCALE_MAX = 2.0**100  # a finite cap for the scale of a tiny (denormal) tensor


class Scaled(NamedTuple):
    """An FP8 tensor and the float32 scalar that restores it: ``value ~ data * scale``."""

    data: jax.Array
    scale: jax.Array


class Fp8Weight(NamedTuple):
    """A weight gathered in FP8 (``zero.fp8_gather``), as an FP8 matmul takes it: its e4m3
    ``data`` and ``scale``, and ``grad``, zeros of the weight's shape in the gather dtype.

    ``grad`` is never read (XLA drops it): it is what the layer's VJP differentiates, so its
    cotangent is the weight's gradient, in the dtype a gathered weight's gradient has.
    ``shape``, ``ndim``, ``size`` and ``dtype`` are the weight's, as an array's would be.
    """

    data: jax.Array
    scale: jax.Array
    grad: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.grad.shape

    @property
    def ndim(self) -> int:
        return self.grad.ndim

    @property
    def size(self) -> int:
        return self.grad.size

    @property
    def dtype(self):
        return self.grad.dtype


def as_operand(w, dtype):
    """A gathered :class:`Scaled` weight as the :class:`Fp8Weight` a layer reads (its
    gradient in ``dtype``); anything else as it is."""
    if isinstance(w, Scaled):
        return Fp8Weight(w.data, w.scale, jnp.zeros(w.data.shape, dtype))
    return w


@jax.custom_vjp
def _restored(data, scale, grad):
    return (data.astype(jnp.float32) * scale).astype(grad.dtype)


def _restored_fwd(data, scale, grad):
    return _restored(data, scale, grad), (data, scale)


def _restored_bwd(res, g):
    data, scale = res
    return jnp.zeros_like(data), jnp.zeros_like(scale), g


_restored.defvjp(_restored_fwd, _restored_bwd)


def dequantized(w):
    """An :class:`Fp8Weight` as an array in its gather dtype, its gradient flowing to
    ``grad`` (for a use other than an FP8 matmul); anything else as it is."""
    return _restored(*w) if isinstance(w, Fp8Weight) else w


def weight_grad(ct):
    """The weight's gradient from an :class:`Fp8Weight`'s cotangent; anything else as it
    is."""
    return ct.grad if isinstance(ct, Fp8Weight) else ct


def _bound_axes() -> tuple[str, ...]:
    axes = []
    for name in _AXES:
        try:
            if lax.axis_size(name) > 1:
                axes.append(name)
        except NameError:  # not inside a shard_map over that axis
            continue
    return tuple(axes)


def global_amax(x: jax.Array) -> jax.Array:
    """``max |x|`` in float32 over the whole tensor: this device's slice, then the maximum
    over every bound mesh axis (axes ``x`` does not vary over give the same value back)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    axes = _bound_axes()
    return lax.pmax(amax, axes) if axes else amax


def quantize(x: jax.Array, dtype=E4M3, *, amax: jax.Array | None = None) -> Scaled:
    """``x`` in ``dtype`` scaled by its current absolute maximum (``amax``, or
    :func:`global_amax`), saturated at the format's largest finite value.

    An all-zero tensor (amax 0) or a non-finite amax gets scale 1, a denormal one a capped
    scale: the scale is never zero, infinite or NaN (a non-finite ``x`` stays non-finite).
    """
    fmax = float(jnp.finfo(dtype).max)
    amax = global_amax(x) if amax is None else amax.astype(jnp.float32)
    ok = jnp.isfinite(amax) & (amax > 0)
    up = jnp.where(ok, jnp.minimum(fmax / jnp.where(ok, amax, 1.0), _SCALE_MAX), 1.0)
    data = jnp.clip(x.astype(jnp.float32) * up, -fmax, fmax).astype(dtype)
    return Scaled(data, 1.0 / up)
