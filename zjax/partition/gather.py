"""The gather primitive and gather-on-access for any params pytree.

``gather`` is a ``custom_vjp``: forward all-gathers a shard in ``gather_dtype``; backward
reduce-scatters the cotangent in ``reduce_dtype`` and returns it in the shard's own dtype
(float32 accumulation). Gathered values are tagged with :data:`GATHERED` so that a remat policy
that refuses to save them (:data:`REMAT_POLICY`) makes the backward pass gather again instead of
keeping every gathered weight alive from forward to backward.

A leaf used twice (tied embeddings, DeepSpeed's external parameters) must be gathered once per
*loss*, not per use site: :func:`gather_tree` gathers each leaf once, so JAX sums the cotangents
of all its uses before the single reduce-scatter in the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zjax.partition._collectives import (
    RING_LONGEST,
    RING_SCOPE,
    SCATTER_METHODS,
    UINT,
    Comm,
    all_gather,
    all_gather_bucket,
    gather_fp8,
    gather_levels,
    gather_within,
    quantized_all_gather,
    reduce_scatter,
    reduce_scatter_bucket,
    ring_factors,
    scatter_levels,
)

__all__ = [
    "GATHERED",
    "REMAT_POLICY",
    "RING_LONGEST",
    "RING_SCOPE",
    "SCATTER_METHODS",
    "UINT",
    "Comm",
    "all_gather",
    "all_gather_bucket",
    "gather",
    "gather_fp8",
    "gather_levels",
    "gather_on_access",
    "gather_tree",
    "gather_within",
    "join_gathers",
    "quantized_all_gather",
    "reduce_scatter",
    "reduce_scatter_bucket",
    "ring_factors",
    "scatter_levels",
]

GATHERED = "zjax_gathered"
_SAVE_ALL_BUT_GATHERED = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
# Views of a value are recomputed from it rather than saved: otherwise ``w.T`` (a residual of
# ``x @ w.T``) would be saved and keep a gathered weight alive from forward to backward.
_RECOMPUTED = frozenset({"transpose", "reshape", "convert_element_type", "broadcast_in_dim",
                    "squeeze", "expand_dims", "copy", "copy_p", "bitcast_convert_type",
                    "reduce_precision",
                    # join_gathers' barrier passes gathered weights through: recompute it too
                    "optimization_barrier"})


def _is_gather_call(params) -> bool:
    jaxpr = getattr(params.get("call_jaxpr"), "jaxpr", None)
    return jaxpr is not None and any(
        eqn.primitive.name == "name" and eqn.params.get("name") == GATHERED for eqn in jaxpr.eqns
    )


def REMAT_POLICY(prim, *avals, **params) -> bool:
    """Remat policy: save everything but gathered weights and views (re-gather in backward)."""
    if prim.name in _RECOMPUTED:
        return False
    if prim.name == "custom_vjp_call" and _is_gather_call(params):
        return False  # the gather primitive, seen from outside as one call
    return _SAVE_ALL_BUT_GATHERED(prim, *avals, **params)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _zjax_gather(x, dim: int, comm: Comm):
    # tagged inside the custom_vjp: under remat its forward is inlined, and the policy must see
    # the gathered value itself (the custom call's output would otherwise be saved). With hpZ
    # the remat runs both levels again (measured: the tied head's weight crosses nodes twice)
    shard = x if comm.quantize else x.astype(comm.gather_dtype)
    return gather_levels(shard, comm, axis=dim, name=GATHERED)[0]


def _zjax_gather_fwd(x, dim, comm):
    # the zero-size residual carries the shard's dtype for the backward cast
    return _zjax_gather(x, dim, comm), jnp.zeros((0,), x.dtype)


def _zjax_gather_bwd(dim, comm, like, g):
    return (scatter_levels(g.astype(comm.reduce_dtype), comm, dim=dim).astype(like.dtype),)


_zjax_gather.defvjp(_zjax_gather_fwd, _zjax_gather_bwd)


def gather(x: jax.Array, *, dim: int | None, comm: Comm = Comm()) -> jax.Array:
    """All-gather shard ``x`` along ``dim`` over ``comm.axes`` (inside ``shard_map``).

    Args:
      x: the local shard.
      dim: the sharded dimension; None means ``x`` is replicated and is only cast.
      comm: the axes, dtypes, host residence and reduce-scatter method.

    Returns:
      The full weight in ``comm.gather_dtype``. Its cotangent comes back to ``x``
      reduce-scattered (summed over the axis) in ``comm.reduce_dtype`` and cast to
      ``x.dtype``.
    """
    c = comm.resolved(x.dtype)
    if c.from_host:  # outside the custom_vjp: the move's transpose sends the cotangent back
        x = jax.device_put(x, jax.memory.Space.Device)
    if not _is_float(x.dtype):
        return x
    if dim is None:
        return x.astype(c.gather_dtype)
    return _zjax_gather(x, dim, c)


def join_gathers(values: list[jax.Array], which: list[bool] | None = None) -> list[jax.Array]:
    """Make gathered weights available together, and their cotangents reduced together.

    One ``lax.optimization_barrier`` over all of them: no value comes out before every gather
    is done, and its transpose holds every cotangent until the last one is ready, so all the
    reduce-scatters follow it. XLA:CPU needs this around a layer loop: it runs a loop's
    collectives in an executor of their own, unordered against the collectives outside, and
    two same-kind collectives in flight at once on a device share one rendezvous key (JAX
    gives every collective channel id 1), which aborts or hangs the step. With the barrier,
    the gathers of weights used after the loop (final norm, head) finish before the loop
    starts, and their reduce-scatters wait for the loop's gradient of the embeddings.
    :func:`zjax.planning.unordered_collectives` checks a compiled step for such pairs.

    Args:
      values: the gathered weights (any values).
      which: per value, whether it is joined (default: all); the others pass unchanged.
    """
    out = list(values)
    picked = [i for i, w in enumerate(which or [True] * len(out)) if w]
    if len(picked) > 1:
        joined = lax.optimization_barrier(tuple(out[i] for i in picked))
        for i, v in zip(picked, joined, strict=True):
            out[i] = v
    return out


def gather_tree(shards: Any, dims: Any, *, comm: Comm = Comm(), join: bool = False) -> Any:
    """Gather every leaf of ``shards`` once (each gathered value is tagged :data:`GATHERED`).

    ``dims`` is a pytree with the structure of ``shards`` holding each leaf's sharded
    dimension or None. With ``join`` the gathered leaves pass :func:`join_gathers`.
    """

    def one(x, dim):
        return gather(x, dim=dim, comm=comm)

    leaves, treedef = jax.tree.flatten(shards)
    # up to the params' structure: a None *entry* of the params (Equinox's filtered models) is
    # an empty subtree there and a None in ``dims``, where None also marks a replicated leaf
    try:
        dim_leaves = treedef.flatten_up_to(dims)
    except (ValueError, TypeError) as e:
        raise ValueError(f"dims do not have the structure of the params: {e}") from None
    out = [one(x, d) for x, d in zip(leaves, dim_leaves, strict=True)]
    if join:
        out = join_gathers(out, [d is not None for d in dim_leaves])
    return jax.tree.unflatten(treedef, out)


def gather_on_access(fn: Callable[..., Any], dims: Any, *, comm: Comm = Comm(),
                     join: bool = False, remat: bool = True) -> Callable[..., Any]:
    """Wrap ``fn(params, *args)`` so it runs on shards: ``fn(shards, *args)``.

    The wrapped function gathers each sharded leaf once (summing the gradients of repeated
    uses before one reduce-scatter); ``join`` passes them through :func:`join_gathers`. With
    ``remat`` the backward pass re-gathers instead of keeping the gathered weights alive
    across the step.
    """

    def wrapped(shards, *args):
        return fn(gather_tree(shards, dims, comm=comm, join=join), *args)

    return jax.checkpoint(wrapped, policy=REMAT_POLICY) if remat else wrapped
