"""FP8 matmuls with tensorwise current scaling (``model.fp8: tensorwise``).

:func:`fp8_matmul` is ``x @ w`` as three FP8 GEMMs: the forward and the input's gradient with
``x``, ``w`` in ``float8_e4m3fn``, the weight's gradient with the output's gradient in
``float8_e5m2`` (the wider range gradients need), each accumulated in float32. Every operand
is scaled by its own *current* absolute maximum (torchao's and Transformer Engine's current
scaling: no amax history to carry or checkpoint), so its largest value lands on the format's
largest finite value.

Inside a zjax step the model runs on each device's slice (``shard_map``): the maximum is
taken over every bound mesh axis (:func:`global_amax`), so a sharded run scales exactly as
one device running the whole batch does.

On an H100 XLA's GPU compiler runs these dots as FP8 GEMMs (cuBLASLt or a Triton GEMM fusion
with ``f8e4m3fn``/``f8e5m2`` operands); XLA:CPU runs them in float32 arithmetic on the
rounded values, which is what the CPU tests compare.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.runtime.mesh import CONTEXT, DATA, EXPERT, MODEL, NODE, REPLICA

__all__ = ["E4M3", "E5M2", "RECIPES", "Scaled", "fp8_matmul", "global_amax", "quantize"]

E4M3 = jnp.float8_e4m3fn  # inputs and weights: more precision
E5M2 = jnp.float8_e5m2  # gradients: more range
RECIPES = ("none", "tensorwise")
_AXES = (REPLICA, NODE, DATA, EXPERT, CONTEXT, MODEL)
_SCALE_MAX = 2.0**100  # a finite cap for the scale of a tiny (denormal) tensor


class Scaled(NamedTuple):
    """An FP8 tensor and the float32 scalar that restores it: ``value ~ data * scale``."""

    data: jax.Array
    scale: jax.Array


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


def _dot(a: Scaled, b: Scaled, dims, dtype) -> jax.Array:
    y = lax.dot_general(a.data, b.data, dims, preferred_element_type=jnp.float32)
    return (y * (a.scale * b.scale)).astype(dtype)


@functools.cache
def _matmul(x_dtype, w_dtype):
    """The custom-gradient FP8 matmul for these input dtypes (the cotangents' dtypes)."""

    @jax.custom_vjp
    def matmul(x, w):
        return forward(x, w)[0]

    def forward(x, w):
        xq, wq = quantize(x), quantize(w)
        return _dot(xq, wq, (((x.ndim - 1,), (0,)), ((), ())), x_dtype), (xq, wq)

    def backward(res, g):
        xq, wq = res
        gq = quantize(g, E5M2)
        dx = _dot(gq, wq, (((g.ndim - 1,), (1,)), ((), ())), x_dtype)
        lead = tuple(range(g.ndim - 1))  # the weight's gradient sums over every token
        dw = _dot(xq, gq, ((lead, lead), ((), ())), w_dtype)
        return dx, dw

    matmul.defvjp(forward, backward)
    return matmul


def fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` (``x``: ``[..., K]``, ``w``: ``[K, N]``) as FP8 GEMMs with tensorwise
    current scaling, forward and backward; the result and ``x``'s gradient in ``x``'s dtype,
    ``w``'s gradient in ``w``'s."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_matmul: x {x.shape} @ w {w.shape}: w must be [K, N] with K "
                         "x's last dimension")
    return _matmul(jnp.dtype(x.dtype), jnp.dtype(w.dtype))(x, w)
