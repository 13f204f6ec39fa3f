"""Megatron-LM's two tensor-parallel operators, for model code that runs on local slices.

Inside a zjax step on a mesh with ``model`` > 1, a weight split over ``model`` arrives as this
device's slice (the rules in :mod:`zjax.partition.rules` say which dimension). A block then
computes with local shapes and marks the two boundaries of each tensor-parallel region:

- :func:`column_parallel_input` before a column-parallel matmul (QKV, MLP up): identity forward;
  backward all-reduces the input's gradient over ``model`` (each device saw part of the columns).
- :func:`row_parallel_output` after a row-parallel matmul (attention output, MLP down):
  all-reduces the partial sums forward; identity backward.

Everything between the regions (the residual stream, norms, their gradients) is then identical
on every ``model`` device. Outside a ``model``-axis context (one device, ``mesh.model: 1``, or
plain JAX) both are the identity, so the same model code runs unsplit.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from zjax.runtime.mesh import MODEL

__all__ = ["column_parallel_input", "model_axis_size", "row_parallel_output"]


def model_axis_size(axis_name: str = MODEL) -> int:
    """Size of the bound ``axis_name`` in the current trace (1 when it is not bound)."""
    try:
        return lax.axis_size(axis_name)
    except NameError:  # not inside a shard_map over that axis
        return 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _copy(x, axis_name):
    return x


_copy.defvjp(lambda x, axis_name: (x, None), lambda axis_name, _, g: (lax.psum(g, axis_name),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce(x, axis_name):
    return lax.psum(x, axis_name)


_reduce.defvjp(lambda x, axis_name: (lax.psum(x, axis_name), None),
               lambda axis_name, _, g: (g,))


def column_parallel_input(x: jax.Array, axis_name: str = MODEL) -> jax.Array:
    """Megatron's *f*: ``x`` enters a column-parallel matmul (gradient summed over the axis)."""
    return _copy(x, axis_name) if model_axis_size(axis_name) > 1 else x


def row_parallel_output(x: jax.Array, axis_name: str = MODEL) -> jax.Array:
    """Megatron's *g*: sum a row-parallel matmul's partial outputs over the axis."""
    return _reduce(x, axis_name) if model_axis_size(axis_name) > 1 else x
