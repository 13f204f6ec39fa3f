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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zjax.partition._quantized import quantized_all_gather, quantized_reduce_scatter
from zjax.partition._rows import from_rows, to_rows

__all__ = [
    "GATHERED",
    "REMAT_POLICY",
    "RING_SCOPE",
    "SCATTER_METHODS",
    "UINT",
    "Comm",
    "all_gather",
    "all_gather_bucket",
    "gather",
    "gather_on_access",
    "gather_tree",
    "join_gathers",
    "quantized_all_gather",
    "reduce_scatter",
    "reduce_scatter_bucket",
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


UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def all_gather(x: jax.Array, axis_name: str, *, axis: int, name: str | None = None) -> jax.Array:
    """Tiled all-gather that moves exactly ``x.dtype``'s bytes.

    XLA's algebraic simplifier moves a float convert that follows an all-gather in front of
    it (so a bf16 gather feeding f32 math would move f32). Gathering the bits as unsigned
    integers of the same width pins the communicated dtype. ``name`` tags the gathered bits
    with ``checkpoint_name`` (the bitcasts around them are views the remat policy recomputes).
    """
    tag = (lambda v: checkpoint_name(v, name)) if name else (lambda v: v)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return tag(lax.all_gather(x, axis_name, axis=axis, tiled=True))
    bits = lax.bitcast_convert_type(x, UINT[x.dtype.itemsize])
    full = tag(lax.all_gather(bits, axis_name, axis=axis, tiled=True))
    return lax.bitcast_convert_type(full, x.dtype)


SCATTER_METHODS = ("direct", "all_reduce", "ring", "quantized")
# the name scope of a ring's collective-permutes: zjax.planning reads them as one reduce-scatter
RING_SCOPE = "zjax_ring_reduce_scatter"


def reduce_scatter(x: jax.Array, axis_name: str, *, dim: int, method: str = "direct",
                   block: int = 256) -> jax.Array:
    """Tiled reduce-scatter of ``x`` along ``dim`` over ``axis_name``.

    ``method`` (:data:`SCATTER_METHODS`):

    - ``direct``: ``lax.psum_scatter``, the compiler's reduce-scatter.
    - ``all_reduce``: an all-reduce, keeping this device's slice: twice the traffic, but
      correct where XLA:CPU's reduce-scatter is not. With ``jax.distributed`` initialised,
      XLA:CPU runs collectives through gloo, whose halving-doubling reduce-scatter
      intermittently returns wrong values at the end of rank 0's chunk, with no error
      (jax-ml/jax#40830; seen here as a silently wrong embedding row on 2 processes).
    - ``ring``: ``n - 1`` collective-permutes of one tile each around the ring of
      ``axis_name``, adding this device's tile of the passing sum at every hop: the bytes of
      a reduce-scatter, on a compiler that would run ``direct`` as an all-reduce (libtpu).
      Sums in a different order than ``direct`` (rounding differs, not the result).
    - ``quantized``: ZeRO++'s qgZ: every device's tile for device j is quantized to blockwise
      int8 (``block`` elements per float32 scale), an all-to-all delivers each device the
      tiles meant for it, and it sums them dequantized in float32: about a quarter of a
      float32 reduce-scatter's bytes, at int8's rounding of each device's contribution.
    """
    if method == "direct":
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
    if method == "quantized":
        return quantized_reduce_scatter(x, axis_name, dim=dim, block=block)
    n = lax.axis_size(axis_name)
    size = x.shape[dim] // n
    me = lax.axis_index(axis_name)
    if method == "all_reduce":
        return lax.dynamic_slice_in_dim(lax.psum(x, axis_name), me * size, size, axis=dim)
    if method != "ring":
        raise ValueError(f"reduce_scatter method {method!r}; choose from {SCATTER_METHODS}")

    def tile(j):
        return lax.dynamic_slice_in_dim(x, (j % n) * size, size, axis=dim)

    # after hop s the passing sum covers devices me - s .. me of tile me - s - 1: after
    # n - 1 hops every device holds the whole sum of its own tile
    with jax.named_scope(RING_SCOPE):
        ring = [(j, (j + 1) % n) for j in range(n)]
        acc = tile(me + n - 1)
        for s in range(1, n):
            acc = lax.ppermute(acc, axis_name, ring) + tile(me + n - 1 - s)
    return acc


def all_gather_bucket(shards: list[jax.Array], dims: list[int], axis_name: str) -> list[jax.Array]:
    """Tiled all-gathers of several shards (each along its ``dims`` entry) as one collective.

    The shards' bits (one dtype width) are flattened into one buffer, gathered once as
    ``(n, total)`` rows (one per device) and split into the gathered leaves. One collective
    per bucket, as DeepSpeed's parameter buckets and FSDP's flat parameters: a compiler that
    runs one asynchronous collective at a time (TPU) can hide the whole bucket behind one
    stretch of compute instead of fitting several gathers between ops.
    """
    width = {x.dtype.itemsize for x in shards}
    if len(width) != 1:
        raise ValueError(f"a bucket holds one dtype width, got {sorted(width)} bytes")
    uint = UINT[width.pop()]
    flat = [lax.bitcast_convert_type(x, uint).reshape(-1) for x in shards]
    rows = lax.all_gather(jnp.concatenate(flat), axis_name, axis=0, tiled=False)
    sizes = np.cumsum([f.size for f in flat])[:-1]
    return [lax.bitcast_convert_type(from_rows(r, x.shape, d), x.dtype)
            for r, x, d in zip(jnp.split(rows, sizes, axis=1), shards, dims, strict=True)]


def reduce_scatter_bucket(values: list[jax.Array], dims: list[int], axis_name: str, *,
                          method: str = "direct", block: int = 256) -> list[jax.Array]:
    """Tiled reduce-scatters of several values (one dtype) as one collective.

    The inverse layout of :func:`all_gather_bucket`: each value's tiles become rows of one
    ``(n, total)`` buffer whose reduce-scatter gives every device its row.
    """
    n = lax.axis_size(axis_name)
    rows = [to_rows(v, d, n) for v, d in zip(values, dims, strict=True)]
    sizes = np.cumsum([r.shape[1] for r in rows])[:-1]
    mine = reduce_scatter(jnp.concatenate(rows, axis=1), axis_name, dim=0, method=method,
                          block=block)[0]
    return [part.reshape(*v.shape[:d], v.shape[d] // n, *v.shape[d + 1:])
            for part, v, d in zip(jnp.split(mine, sizes), values, dims, strict=True)]


@dataclasses.dataclass(frozen=True)
class Comm:
    """How ZeRO moves parameters: one record for every gather and reduce-scatter.

    Attributes:
      axis_name: the mesh axis the shards are spread over.
      gather_dtype: dtype floating weights are gathered and computed in (None: the shard's).
      reduce_dtype: dtype their gradients are reduce-scattered in (None: the shard's).
      from_host: the shards live in host memory (``zero.offload_param``): each is brought to
        the device as it is gathered, and its gradient goes back to host memory.
      scatter: how gradients are reduce-scattered (:func:`reduce_scatter`'s ``method``).
      quantize: gather floating shards as blockwise int8 (:func:`quantized_all_gather`,
        ZeRO++'s qwZ) instead of in ``gather_dtype``.
      block: elements per quantization block (quantized gathers, and the ``quantized``
        reduce-scatter).
    """

    axis_name: str = "data"
    gather_dtype: Any = None
    reduce_dtype: Any = None
    from_host: bool = False
    scatter: str = "direct"
    quantize: bool = False
    block: int = 256

    def resolved(self, dtype) -> Comm:
        """This record with the dtypes left None set to ``dtype``."""
        return dataclasses.replace(self, gather_dtype=np.dtype(self.gather_dtype or dtype),
                                   reduce_dtype=np.dtype(self.reduce_dtype or dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6, 7))
def _zjax_gather(x, dim: int, axis_name: str, gather_dtype, reduce_dtype, scatter: str,
                 quantize: bool, block: int):
    # tagged inside the custom_vjp: under remat its forward is inlined, and the policy must see
    # the gathered value itself (the custom call's output would otherwise be saved)
    if quantize:
        return quantized_all_gather(x, axis_name, axis=dim, block=block, dtype=gather_dtype,
                                    name=GATHERED)
    return all_gather(x.astype(gather_dtype), axis_name, axis=dim, name=GATHERED)


def _zjax_gather_fwd(x, dim, axis_name, gather_dtype, reduce_dtype, scatter, quantize,
                     block):
    # the zero-size residual carries the shard's dtype for the backward cast
    out = _zjax_gather(x, dim, axis_name, gather_dtype, reduce_dtype, scatter, quantize, block)
    return out, jnp.zeros((0,), x.dtype)


def _zjax_gather_bwd(dim, axis_name, gather_dtype, reduce_dtype, scatter, quantize, block,
                     like, g):
    shard = reduce_scatter(g.astype(reduce_dtype), axis_name, dim=dim, method=scatter,
                           block=block)
    return (shard.astype(like.dtype),)


_zjax_gather.defvjp(_zjax_gather_fwd, _zjax_gather_bwd)


def gather(x: jax.Array, *, dim: int | None, comm: Comm = Comm()) -> jax.Array:
    """All-gather shard ``x`` along ``dim`` over ``comm.axis_name`` (inside ``shard_map``).

    Args:
      x: the local shard.
      dim: the sharded dimension; None means ``x`` is replicated and is only cast.
      comm: the axis, dtypes, host residence and reduce-scatter method.

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
    return _zjax_gather(x, dim, c.axis_name, c.gather_dtype, c.reduce_dtype, c.scatter,
                        c.quantize, c.block)


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
