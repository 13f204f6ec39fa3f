"""Collectives of the context axis that move exactly their operand's dtype.

XLA's algebraic simplifier moves a float convert that follows a collective in front of it: a
bfloat16 all-to-all feeding float32 attention math would move float32, twice the bytes
(measured on XLA:CPU for Ulysses' all-to-alls). Moving the bits as unsigned integers of the
same width pins the dtype; the all-to-all gets its own VJP (the transposed all-to-all, also in
bits), since gradients do not flow through a bitcast to integers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["all_to_all", "ppermute", "varying_zeros"]

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _via_bits(collective, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return collective(x)
    bits = collective(lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]))
    return lax.bitcast_convert_type(bits, x.dtype)


def _tiled_all_to_all(x, axis_name, split: int, concat: int):
    return _via_bits(lambda b: lax.all_to_all(b, axis_name, split, concat, tiled=True), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_to_all(x: jax.Array, axis_name, split: int, concat: int) -> jax.Array:
    """``lax.all_to_all(x, axis_name, split, concat, tiled=True)`` in ``x``'s own dtype."""
    return _tiled_all_to_all(x, axis_name, split, concat)


all_to_all.defvjp(
    lambda x, axis_name, split, concat: (_tiled_all_to_all(x, axis_name, split, concat), None),
    lambda axis_name, split, concat, _, g: (_tiled_all_to_all(g, axis_name, concat, split),))


def ppermute(x: jax.Array, axis_name, perm) -> jax.Array:
    """``lax.ppermute`` in ``x``'s own dtype (not differentiable: inside a custom VJP)."""
    return _via_bits(lambda b: lax.ppermute(b, axis_name, perm), x)


def varying_zeros(shape, dtype, *like: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """Zeros that vary over ``axes`` and the mesh axes any of ``like`` vary over: a loop's
    initial carry must match its updates under ``shard_map``'s type checks (without them the
    arrays carry no such axes and this is ``jnp.zeros``)."""
    vary = set(axes)
    for x in like:
        vary |= _varying_axes(jax.typeof(x))
    z = jnp.zeros(shape, dtype)
    return lax.pcast(z, tuple(sorted(vary)), to="varying") if vary else z


def _varying_axes(aval) -> set[str]:
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; earlier: ``vma``
    return set(mat.varying if mat is not None else getattr(aval, "vma", ()))
