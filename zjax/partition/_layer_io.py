"""What a layer loop keeps between its forward and backward, and the cotangent plumbing of
its carries: helpers of :mod:`zjax.partition.schedule`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["cotangent", "float_or_none", "grad_dtype", "input_keeping", "is_float", "refill",
           "slice_layer"]


def _moved(tree, space):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def input_keeping(axis: str | None, *, offload: bool):
    """``(keep, restore)``: how a saved layer input is stored for the backward (partitioned
    split over mesh ``axis``, in host memory with ``offload``) and brought back."""
    n = lax.axis_size(axis) if axis is not None else 1

    def split(x):
        return n > 1 and is_float(x) and len(x.shape) > 0 and x.shape[-1] % n == 0

    def keep(h):
        def one(x):
            if split(x):
                part = x.shape[-1] // n
                x = lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * part, part, axis=-1)
            return x
        h = jax.tree.map(one, h)
        return _moved(h, jax.memory.Space.Host) if offload else h

    def restore(h, like):
        """``like``: the inputs' avals (which leaves ``keep`` split)."""
        h = _moved(h, jax.memory.Space.Device) if offload else h
        return jax.tree.map(lambda x, a: lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)
                            if split(a) else x, h, like)

    return keep, restore


def slice_layer(leaf, i):
    return lax.dynamic_index_in_dim(leaf, i, 0, keepdims=False)


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def cotangent(x, ct):
    """``ct`` as ``jax.vjp`` wants it for primal ``x``: float0 zeros for integer values."""
    if not is_float(x):
        return np.zeros(np.shape(x), jax.dtypes.float0)
    return jnp.zeros_like(x) if ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0 \
        else ct


def float_or_none(ct, x):
    return ct if is_float(x) else None


def refill(like: Any, float_cts: list) -> Any:
    """Cotangents shaped like ``like``: ``float_cts`` in order for its float leaves, None for
    the others (a custom_vjp's zero cotangent)."""
    it = iter(float_cts)
    return jax.tree.map(lambda x: next(it) if is_float(x) else None, like)


def grad_dtype(leaf, dim, comm) -> np.dtype:
    """A layer loop's gradient stack: sharded float shards stay in a narrower reduce dtype
    until the loop ends (the same values, half a float32 buffer); not in host memory, which
    would come back to be cast, nor after a quantized reduce (float32)."""
    narrow = (dim is not None and is_float(leaf) and not comm.from_host and not comm.quantize
              and comm.reduce_dtype.itemsize < leaf.dtype.itemsize)
    return comm.reduce_dtype if narrow else leaf.dtype
