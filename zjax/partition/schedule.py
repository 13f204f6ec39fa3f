"""The scheduled layer scan: ZeRO-3 over a stack of L identical layers.

One ``jax.custom_vjp`` over the whole stack (params stacked ``[L, ...]``, held as shards):

- forward: ``lax.scan``; iteration i runs layer i on weights gathered earlier and issues the
  gather of layer ``i + k`` (``k`` = prefetch depth). Only the layer inputs are saved.
- backward: a reverse ``lax.scan``; iteration i recomputes layer i from its saved input on
  weights gathered earlier, issues the gather of layer ``i - k``, takes the layer VJP and
  reduce-scatters ``dW_i`` into the shard gradient at once.

So the gathered working set is ``1 + k`` layers forward and ``2 + k`` backward (the layer's
gathered weights, its full-size gradient, and the prefetched ones) whatever L is, and the
collectives are exactly 2 all-gathers and 1 reduce-scatter of every sharded layer leaf.
The first ``k`` gathers are issued before the loop and the last ``k`` layers run unrolled
after it (their inputs kept apart, so the saved inputs are never copied into one buffer); the
backward mirrors this, so no gather is ever wasted on a layer that does not exist. The depth is
at most ``L // 2``.

Leaves with ``dim`` None (persistent, replicated) are sliced and cast, never communicated; their
gradients are returned un-reduced (each replica's local sum) for the caller to all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zjax.partition.gather import all_gather, reduce_scatter

__all__ = ["ScheduleSpec", "scheduled_scan"]


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """Static description of how a stack's leaves are laid out and moved.

    Attributes:
      dims: per flattened leaf, the sharded dimension of the *stacked* leaf (>= 1), or None.
      axis_name: mesh axis the shards are spread over.
      gather_dtype: dtype weights are gathered and computed in.
      reduce_dtype: dtype gradients are reduce-scattered in.
      prefetch: how many layers ahead to gather.
      from_host: the stacked shards live in host memory (``zero.offload_param``): each
        layer's slice is brought to the device as it is gathered, and each layer's gradient
        shard goes back into a host buffer as soon as it is reduce-scattered.
      scatter_via_all_reduce: reduce-scatter with an all-reduce and a slice
        (:func:`~zjax.partition.gather.reduce_scatter`).
    """

    dims: tuple[int | None, ...]
    axis_name: str = "data"
    gather_dtype: Any = np.float32
    reduce_dtype: Any = np.float32
    prefetch: int = 1
    from_host: bool = False
    scatter_via_all_reduce: bool = False


def _slice(leaf, i):
    return lax.dynamic_index_in_dim(leaf, i, 0, keepdims=False)


def scheduled_scan(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    stacked_params: Any,
    x: jax.Array,
    *,
    spec: ScheduleSpec,
) -> jax.Array:
    """Run ``x`` through L layers whose params are stacked shards (inside ``shard_map``).

    Args:
      layer_fn: ``layer_fn(params_of_one_layer, x) -> y`` with ``y`` like ``x``; pure.
      stacked_params: pytree of local shards with leading layer dimension L.
      x: the activations entering layer 0.
      spec: leaf layout, dtypes and prefetch depth.

    Returns:
      The output of layer L-1. Differentiable: cotangents of sharded leaves come back
      reduce-scattered over ``spec.axis_name`` in each leaf's own dtype.
    """
    leaves, treedef = jax.tree.flatten(stacked_params)
    if len(leaves) != len(spec.dims):
        raise ValueError(f"spec has {len(spec.dims)} dims for {len(leaves)} stacked leaves")
    if not leaves:
        raise ValueError("scheduled_scan needs at least one stacked leaf")
    n_layers = leaves[0].shape[0]
    k = min(spec.prefetch, n_layers // 2)  # the backward runs k tail + k head layers unrolled
    gather_dtype = np.dtype(spec.gather_dtype)
    reduce_dtype = np.dtype(spec.reduce_dtype)

    to_device = (lambda x: jax.device_put(x, jax.memory.Space.Device)) if spec.from_host \
        else (lambda x: x)
    to_home = (lambda x: jax.device_put(x, jax.memory.Space.Host)) if spec.from_host \
        else (lambda x: x)

    def gather_layer(leaves, i):
        out = []
        for leaf, dim in zip(leaves, spec.dims, strict=True):
            w = to_device(_slice(leaf, i))
            if jnp.issubdtype(w.dtype, jnp.floating):
                w = w.astype(gather_dtype)
            if dim is not None:
                w = all_gather(w, spec.axis_name, axis=dim - 1)
            out.append(w)
        return tuple(out)

    def apply(ws, h):
        return layer_fn(jax.tree.unflatten(treedef, list(ws)), h)

    def forward(leaves, x, *, save: bool):
        buf = tuple(gather_layer(leaves, j) for j in range(k))

        def body(carry, i):
            h, buf = carry
            if k:
                ws, buf = buf[0], (*buf[1:], gather_layer(leaves, i + k))
            else:
                ws = gather_layer(leaves, i)
            return (apply(ws, h), buf), h if save else None

        # the layer inputs leave the loop as its stacked outputs: a buffer threaded through the
        # carry instead is stacked once per iteration when an outer jax.checkpoint
        # partial-evaluates this loop (memory quadratic in L)
        (h, buf), xs = lax.scan(body, (x, buf), jnp.arange(n_layers - k))
        tail = []
        for j in range(k):  # the last k layers: their weights are already here
            tail.append(h)
            h = apply(buf[j], h)
        return h, (xs, tuple(tail))

    @jax.custom_vjp
    def run(leaves, x):
        return forward(leaves, x, save=False)[0]

    def run_fwd(leaves, x):
        y, saved = forward(leaves, x, save=True)
        return y, (leaves, saved)

    def run_bwd(res, dy):
        leaves, (xs, tail) = res
        # tie the backward gathers to the cotangent: XLA can neither hoist them into the
        # forward pass nor merge them (CSE) with the forward's gathers of the same layers
        leaves, dy = lax.optimization_barrier((leaves, dy))

        def layer_vjp(ws, i, x_i, dy, grads):
            _, vjp = jax.vjp(apply, ws, x_i)
            dws, dx = vjp(dy)
            new = []
            for g, dw, dim, leaf in zip(grads, dws, spec.dims, leaves, strict=True):
                if dim is not None:
                    dw = reduce_scatter(dw.astype(reduce_dtype), spec.axis_name, dim=dim - 1,
                                        via_all_reduce=spec.scatter_via_all_reduce)
                new.append(lax.dynamic_update_index_in_dim(g, to_home(dw.astype(leaf.dtype)), i, 0))
            return dx, tuple(new)

        def advance(buf, i):
            """The weights of layer i, and the buffer with layer i - k's gather issued."""
            if not k:
                return gather_layer(leaves, i), buf
            return buf[0], (*buf[1:], gather_layer(leaves, i - k))

        grads = tuple(to_home(jnp.zeros(leaf.shape, leaf.dtype)) for leaf in leaves)
        buf = tuple(gather_layer(leaves, n_layers - 1 - j) for j in range(k))
        for j in range(k):  # the last k layers, whose inputs the forward kept apart
            i = n_layers - 1 - j
            ws, buf = advance(buf, i)
            dy, grads = layer_vjp(ws, i, tail[k - 1 - j], dy, grads)

        def body(carry, t):
            dy, buf, grads = carry
            i = n_layers - 1 - k - t
            ws, buf = advance(buf, i)
            dy, grads = layer_vjp(ws, i, _slice(xs, i), dy, grads)
            return (dy, buf, grads), None

        (dy, buf, grads), _ = lax.scan(body, (dy, buf, grads), jnp.arange(n_layers - 2 * k))
        for j in range(k):  # layers k-1 .. 0, already gathered
            i = k - 1 - j
            dy, grads = layer_vjp(buf[j], i, _slice(xs, i), dy, grads)
        return grads, dy

    run.defvjp(run_fwd, run_bwd)
    return run(tuple(leaves), x)
