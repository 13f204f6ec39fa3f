"""FP8 matmuls with tensorwise current scaling (``model.fp8: tensorwise``).

:func:`fp8_matmul` is ``x @ w`` as three FP8 GEMMs: the forward and the input's gradient with
``x``, ``w`` in ``float8_e4m3fn``, the weight's gradient with the output's gradient in
``float8_e5m2`` (the wider range gradients need), each accumulated in float32. Every operand
is scaled by its own *current* absolute maximum over the whole tensor, across the mesh
(:func:`zjax.partition.fp8.quantize`: no amax history to carry or checkpoint), so its largest
value lands on the format's largest finite value.

On an H100 XLA's GPU compiler runs these dots as FP8 GEMMs (cuBLASLt or a Triton GEMM fusion
with ``f8e4m3fn``/``f8e5m2`` operands); XLA:CPU runs them in float32 arithmetic on the
rounded values, which is what the CPU tests compare.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zjax.partition.fp8 import (
    E4M3,
    E5M2,
    Fp8Weight,
    Scaled,
    dequantized,
    global_amax,
    quantize,
)

__all__ = ["E4M3", "E5M2", "RECIPES", "Fp8Weight", "Scaled", "dequantized", "fp8_matmul",
           "global_amax", "quantize"]

RECIPES = ("none", "tensorwise")


def _dot(a: Scaled, b: Scaled, dims, dtype) -> jax.Array:
    y = lax.dot_general(a.data, b.data, dims, preferred_element_type=jnp.float32)
    return (y * (a.scale * b.scale)).astype(dtype)


def _product(xq: Scaled, wq: Scaled, dtype) -> jax.Array:
    """``x @ w`` (``x``: ``[..., K]``, ``w``: ``[K, N]``) from their FP8 forms."""
    return _dot(xq, wq, (((xq.data.ndim - 1,), (0,)), ((), ())), dtype)


def _gradients(xq: Scaled, wq: Scaled, g: jax.Array, x_dtype, w_dtype):
    """``x``'s and ``w``'s gradients from the output's ``g`` (quantized to e5m2)."""
    gq = quantize(g, E5M2)
    dx = _dot(gq, wq, (((g.ndim - 1,), (1,)), ((), ())), x_dtype)
    lead = tuple(range(g.ndim - 1))  # the weight's gradient sums over every token
    return dx, _dot(xq, gq, ((lead, lead), ((), ())), w_dtype)


@functools.cache
def _matmul(x_dtype, w_dtype):
    """The custom-gradient FP8 matmul for these input dtypes (the cotangents' dtypes)."""

    @jax.custom_vjp
    def matmul(x, w):
        return forward(x, w)[0]

    def forward(x, w):
        xq, wq = quantize(x), quantize(w)
        return _product(xq, wq, x_dtype), (xq, wq)

    def backward(res, g):
        return _gradients(*res, g, x_dtype, w_dtype)

    matmul.defvjp(forward, backward)
    return matmul


@functools.cache
def _prescaled(x_dtype):
    """The FP8 matmul of a weight gathered in FP8 (:class:`Fp8Weight`): its bytes and scale
    go to the GEMMs as they are; its gradient is ``grad``'s cotangent."""

    @jax.custom_vjp
    def matmul(x, data, scale, grad):
        return forward(x, data, scale, grad)[0]

    def forward(x, data, scale, grad):
        xq = quantize(x)
        return _product(xq, Scaled(data, scale), x_dtype), (xq, data, scale,
                                                            jnp.zeros((0,), grad.dtype))

    def backward(res, g):
        xq, data, scale, like = res
        dx, dw = _gradients(xq, Scaled(data, scale), g, x_dtype, like.dtype)
        return dx, jnp.zeros_like(data), jnp.zeros_like(scale), dw

    matmul.defvjp(forward, backward)
    return matmul


def fp8_matmul(x: jax.Array, w: jax.Array | Fp8Weight) -> jax.Array:
    """``x @ w`` (``x``: ``[..., K]``, ``w``: ``[K, N]``) as FP8 GEMMs with tensorwise
    current scaling, forward and backward; the result and ``x``'s gradient in ``x``'s dtype,
    ``w``'s gradient in ``w``'s.

    ``w`` may be an :class:`Fp8Weight` (a weight ``zero.fp8_gather`` gathered in FP8): its
    bytes and scale feed the GEMMs directly, and its gradient is ``w.grad``'s cotangent."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_matmul: x {x.shape} @ w {w.shape}: w must be [K, N] with K "
                         "x's last dimension")
    if isinstance(w, Fp8Weight):
        return _prescaled(jnp.dtype(x.dtype))(x, w.data, w.scale, w.grad)
    return _matmul(jnp.dtype(x.dtype), jnp.dtype(w.dtype))(x, w)
