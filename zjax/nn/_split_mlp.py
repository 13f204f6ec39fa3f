"""An MLP computed a slice of its hidden units at a time, with the weights' gradients written
slice by slice (no accumulation across slices).

``hidden(x, *ins) @ down`` where each array of ``ins`` has the hidden units on its last axis
(the up-projections and their biases) and ``down`` on its first: slice ``j`` of the hidden
units needs slice ``j`` of every weight, and gives slice ``j`` of every weight's gradient
(one matmul over all the tokens, as the whole MLP's backward computes it). Only the output
and the input's gradient are sums over slices (``tokens x d_model``, float32).

Tiling over tokens instead (:func:`zjax.nn.tiled`) sums each weight's gradient over the token
chunks: a float32-accumulated buffer the size of the weights beside each chunk's share, which
costs more than the hidden units it saves when a device's tokens are few next to the layer's
width (a trillion-parameter layer, 20480 x 81920, at 4096 tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._wire import varying_zeros

__all__ = ["split_hidden"]


def _slices(ins, down, j, width: int):
    return (tuple(lax.dynamic_slice_in_dim(a, j * width, width, axis=a.ndim - 1) for a in ins),
            lax.dynamic_slice_in_dim(down, j * width, width, axis=0))


def _dot(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def split_hidden(hidden: Callable, x: jax.Array, ins: tuple, down: jax.Array,
                 pieces: int) -> jax.Array:
    """``hidden(x, *ins) @ down``, ``d_ff / pieces`` hidden units at a time.

    Args:
      hidden: ``(x [N, D], *slices) -> [N, c]``: the hidden units of a slice of the weights.
      x: ``[N, D]`` tokens.
      ins: arrays with the ``d_ff`` hidden units on their last axis.
      down: ``[d_ff, D_out]``.
      pieces: slices; divides ``d_ff``.

    Returns:
      ``[N, D_out]`` in the dtype of ``hidden``'s output with ``down``.
    """
    width = down.shape[0] // pieces

    def body(j, acc):
        sl, dn = _slices(ins, down, j, width)
        return acc + _dot(hidden(x, *sl), dn)

    init = varying_zeros((x.shape[0], down.shape[1]), jnp.float32, x, *ins, down)
    out = lax.fori_loop(0, pieces, body, init)
    h = jax.eval_shape(hidden, x, *_slices(ins, down, 0, width)[0])
    return out.astype(jnp.result_type(h.dtype, down.dtype))


def _fwd(hidden, x, ins, down, pieces):
    return split_hidden(hidden, x, ins, down, pieces), (x, ins, down)


def _bwd(hidden, pieces, res, g):
    x, ins, down = res
    width = down.shape[0] // pieces

    def body(j, carry):
        dx, d_ins, d_down = carry
        sl, dn = _slices(ins, down, j, width)
        h, vjp = jax.vjp(lambda x, *s: hidden(x, *s), x, *sl)  # the slice recomputed
        dxj, *d_sl = vjp(_dot(g, dn.T).astype(h.dtype))
        d_ins = tuple(lax.dynamic_update_slice_in_dim(a, s.astype(a.dtype), j * width,
                                                      axis=a.ndim - 1)
                      for a, s in zip(d_ins, d_sl, strict=True))
        d_down = lax.dynamic_update_slice_in_dim(d_down, _dot(h.T, g).astype(down.dtype),
                                                 j * width, axis=0)
        return dx + dxj.astype(jnp.float32), d_ins, d_down

    like = (x, g, *ins, down)
    init = (varying_zeros(x.shape, jnp.float32, *like),
            tuple(varying_zeros(a.shape, a.dtype, *like) for a in ins),
            varying_zeros(down.shape, down.dtype, *like))
    dx, d_ins, d_down = lax.fori_loop(0, pieces, body, init)
    return dx.astype(x.dtype), d_ins, d_down


split_hidden.defvjp(_fwd, _bwd)
