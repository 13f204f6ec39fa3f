"""The scheduled layer scan: ZeRO-3 over a stack of L identical layers.

One ``jax.custom_vjp`` over the whole stack (params stacked ``[L, ...]``, held as shards):

- forward: ``lax.scan``; iteration i runs layer i on weights gathered earlier and issues the
  gather of layer ``i + k`` (``k`` = prefetch depth). Only the layer inputs are saved.
- backward: a reverse ``lax.scan``; iteration i recomputes layer i from its saved input on
  weights gathered earlier, issues the gather of layer ``i - k``, takes the layer VJP and
  reduce-scatters ``dW_i`` into the shard gradient at once.

So the gathered working set is ``1 + k`` layers forward and ``2 + k`` backward (the layer's
gathered weights, its full-size gradient, and the prefetched ones) whatever L is. On TPU
(``Comm.prefetch_before_vjp``) the backward's prefetch arrives before its layer's VJP starts,
during the recomputed forward, not in flight across the VJP, where the step peaks. Both passes
are one loop over all L layers, with nothing unrolled around them: a layer unrolled outside a
loop gets temporaries of its own on every backend (measured: one unrolled layer costs as much
temp as 4 gathered layers on H100 at d_model 1024, 4k tokens per device; three of them put
stage 3 above GSPMD FSDP on TPU). The forward's first ``k`` gathers are issued before its loop;
past the last layer its prefetches fetch layers L-1, L-2, ... (what the backward needs first)
and hand them to the backward, so the forward wastes nothing. The backward's last ``k``
prefetches, past layer 0, have nothing left to fetch and gather layer 0 again: each step gathers
``k`` layers more than ``2 x L`` (``k / 2L`` of the stack's gather bytes; 3% at k = 1, L = 16),
the price of a drain inside the loop. Reduce-scatters are exactly one per layer. The depth is
at most ``L // 2`` (:meth:`zjax.partition.ZeroConfig.prefetch_depth`).

Leaves with ``dim`` None (persistent, replicated) are sliced and cast, never communicated; their
gradients are returned un-reduced (each replica's local sum) for the caller to all-reduce.

With ZeRO++'s hierarchical partition (``Comm.node_axis``), the forward's gathers run across
nodes and then within the node; the slices from the first level (the secondary partition) leave
the forward loop as stacked outputs, and the backward gathers them within the node only. Its
reduce-scatters run within the node, then across: per leaf, the cross-node level of layer i's
gradient is issued at the start of the next iteration, overlapping layer i-1's compute (the
first iteration sends zeros: 1/L more of that level's bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zjax.partition._layer_io import (
    cotangent,
    float_or_none,
    grad_dtype,
    input_keeping,
    is_float,
    refill,
    slice_layer,
)
from zjax.partition._schedule_spec import ScheduleSpec, bucket_groups, over_cap
from zjax.partition.fp8 import as_operand, weight_grad
from zjax.partition.gather import (
    UINT,
    all_gather_bucket,
    gather_fp8,
    gather_levels,
    gather_within,
    reduce_scatter,
    reduce_scatter_bucket,
    scatter_levels,
)

LAYER_INPUTS = "zjax_layer_inputs"

__all__ = ["ScheduleSpec", "scheduled_loop", "scheduled_scan"]


def scheduled_scan(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    stacked_params: Any,
    x: jax.Array,
    *,
    spec: ScheduleSpec,
    context: Any = None,
    index: jax.Array | None = None,
) -> jax.Array:
    """Run ``x`` through L layers whose params are stacked shards (inside ``shard_map``).

    Args:
      layer_fn: ``layer_fn(params_of_one_layer, x) -> y`` with ``y`` like ``x``; pure.
      stacked_params: pytree of local shards with leading layer dimension L.
      x: the activations entering layer 0.
      spec: leaf layout, dtypes and prefetch depth.
      context: values every layer reads besides ``x`` (packed documents' segment ids and
        positions), passed as ``layer_fn(params, x, context)``; None: ``layer_fn(params, x)``.
      index: ``[L]`` per-layer ints (a ``Stack``'s layer indices), passed to layer ``i`` as
        the keyword ``index=index[i]``; None: not passed.

    Returns:
      The output of layer L-1. Differentiable: cotangents of sharded leaves come back
      reduce-scattered over ``spec.comm.axis_name`` in each leaf's own dtype.
    """
    def body(params, consts, h, xs):
        args = () if context is None else (consts,)
        kw = {} if index is None else {"index": xs}
        return layer_fn(params, h, *args, **kw), None

    consts = () if context is None else context
    return scheduled_loop(body, stacked_params, consts, x, index, spec=spec)[0]


def scheduled_loop(
    body: Callable[[Any, Any, Any, Any], tuple[Any, Any]],
    stacked_params: Any,
    consts: Any,
    carry: Any,
    xs: Any,
    *,
    spec: ScheduleSpec,
) -> tuple[Any, Any]:
    """A ``lax.scan`` over L layers whose params are stacked shards (inside ``shard_map``).

    The general form of :func:`scheduled_scan`, for any scan body (the gather-on-use transform
    rewrites a model's own layer scans into it).

    Args:
      body: ``body(params_i, consts, carry, xs_i) -> (carry, ys_i)``; pure.
      stacked_params: pytree of local shards with leading layer dimension L.
      consts: values every iteration reads (gradients are summed over the iterations).
      carry: the initial carry.
      xs: per-iteration inputs with leading dimension L (or None).
      spec: leaf layout, dtypes and prefetch depth.

    Returns:
      ``(carry, ys)`` as ``lax.scan`` returns them.
    """
    leaves_in, treedef = jax.tree.flatten(stacked_params)
    if len(leaves_in) != len(spec.dims):
        raise ValueError(f"spec has {len(spec.dims)} dims for {len(leaves_in)} stacked leaves")
    if not leaves_in:
        raise ValueError("scheduled_scan needs at least one stacked leaf")
    n_layers = leaves_in[0].shape[0]
    k = min(spec.prefetch, n_layers)
    comm = spec.comm.resolved(np.float32)
    gather_dtype, reduce_dtype = comm.gather_dtype, comm.reduce_dtype
    comms = spec.comms(comm)  # each leaf's own axes (a mixture's experts: without expert)

    to_device = (lambda x: jax.device_put(x, jax.memory.Space.Device)) if comm.from_host \
        else (lambda x: x)
    to_home = (lambda x: jax.device_put(x, jax.memory.Space.Host)) if comm.from_host \
        else (lambda x: x)

    keep, restore = input_keeping(spec.partition_inputs, offload=spec.offload_inputs)

    # the leaves moved as one bucket (spec.bucket): sharded float leaves, if more than one;
    # never without prefetch (a layer's bucket would arrive whole before any of its compute)
    frozen = [spec.is_frozen(i) for i in range(len(leaves_in))]
    bucketed = [d is not None and is_float(x) and c is comm and not f
                for x, d, c, f in zip(leaves_in, spec.dims, comms, frozen, strict=True)]
    hpz = comm.node_axis is not None
    if not spec.bucket or not k or sum(bucketed) < 2 or comm.quantize:
        bucketed = [False] * len(bucketed)
    # one bucket a layer, or (a layer over BUCKET_CAP_BYTES) runs of leaves up to it
    candidates = [i for i, b in enumerate(bucketed) if b]
    buckets = bucket_groups(candidates, leaves_in, comm)
    bucketed = [any(i in g for g in buckets) for i in range(len(bucketed))]
    bucket_dims = [[spec.dims[j] - 1 for j in g] for g in buckets]
    # a layer over the cap: its gathers in runs, its gradients reduced leaf by leaf (joining
    # them is one more copy of the run; the ring's permutes overlap one by one anyway)
    joined = not over_cap(buckets, candidates)
    scattered = [b and joined for b in bucketed]  # reduce-scattered with their bucket

    def gather_layer(leaves, i):
        """Layer ``i``'s weights, and (hpZ) their secondary partitions, kept for the backward."""
        out, secondary = [], []
        for leaf, dim, b, lc in zip(leaves, spec.dims, bucketed, comms, strict=True):
            w, sec = to_device(slice_layer(leaf, i)), None
            floating = jnp.issubdtype(w.dtype, jnp.floating)
            if floating and not ((comm.quantize or lc.fp8) and dim is not None):
                w = comm.cast(w)  # (quantized from the float32 shard itself)
            if dim is not None and floating and lc.fp8:  # bytes and a scale, for the GEMM
                w = gather_fp8(w, lc, axis=dim - 1)
            elif dim is not None and not b:
                c = lc if floating else dataclasses.replace(lc, quantize=False)
                w, sec = gather_levels(w, c, axis=dim - 1)
            out.append(w)
            secondary.append(sec)
        for group, dims in zip(buckets, bucket_dims, strict=True):
            # split as soon as gathered: carrying the rows to the use measured worse on TPU
            # (v5p:2x2x2, d_model 1024: temp 897 -> 923 MB at prefetch 1)
            parts = [out[j] for j in group]
            if hpz:  # one bucket per level; the first level's leaves kept as their bits
                parts = all_gather_bucket(parts, dims, comm.node_axis)
                for j, c in zip(group, parts, strict=True):
                    secondary[j] = lax.bitcast_convert_type(c, UINT[c.dtype.itemsize])
            for j, w in zip(group, all_gather_bucket(parts, dims, comm.axis_name), strict=True):
                out[j] = w
        return tuple(out), tuple(secondary)

    def regather_layer(leaves, secondary, i):
        """Layer ``i``'s weights for the backward: with hpZ, gathered within the node from
        the secondary partitions the forward kept."""
        if not hpz:
            return gather_layer(leaves, i)[0]
        out = []
        for leaf, dim, sec, b in zip(leaves, spec.dims, secondary, bucketed, strict=True):
            if b:  # gathered with the bucket, below
                out.append(None)
                continue
            if dim is None:  # never communicated: sliced and cast
                w = to_device(slice_layer(leaf, i))
                out.append(comm.cast(w) if is_float(w) else w)
                continue
            floating = is_float(leaf)
            c = comm if floating else dataclasses.replace(comm, quantize=False)
            out.append(gather_within(jax.tree.map(lambda v: slice_layer(v, i), sec), c,
                                     axis=dim - 1, shard_shape=leaf.shape[1:],
                                     dtype=gather_dtype if floating else leaf.dtype))
        for group, dims in zip(buckets, bucket_dims, strict=True):
            parts = [lax.bitcast_convert_type(slice_layer(secondary[j], i), gather_dtype)
                     for j in group]
            for j, w in zip(group, all_gather_bucket(parts, dims, comm.axis_name), strict=True):
                out[j] = w
        return tuple(out)

    def apply(ws, consts, h, x_i):  # FP8-gathered weights read as FP8 operands
        ws = [as_operand(w, gather_dtype) for w in ws]
        return body(jax.tree.unflatten(treedef, ws), consts, h, x_i)

    def with_trained(ws, trained):
        """``ws`` with its trained leaves (those not frozen, in order) replaced."""
        it = iter(trained)
        return tuple(w if f else next(it) for w, f in zip(ws, frozen, strict=True))

    def prefetch_index(j):
        """The layer the forward gathers for position ``j``: past the end, the layers the
        backward needs first (L-1, L-2, ...), so the forward's last prefetches are the
        backward's first weights."""
        return jnp.where(j < n_layers, j, 2 * n_layers - 1 - j)

    def forward(leaves, consts, carry, xs, *, save: bool):
        buf = tuple(gather_layer(leaves, j) for j in range(k))

        def step(c, inp):
            h, buf = c
            i, x_i = inp
            if k:
                (ws, sec), buf = buf[0], (*buf[1:], gather_layer(leaves, prefetch_index(i + k)))
            else:
                ws, sec = gather_layer(leaves, i)
            h_next, y = apply(ws, consts, h, x_i)
            kept = keep(h) if save else None
            return (h_next, buf), (y, kept, sec if save and hpz else None)

        # the layer inputs (and hpZ's secondary partitions) leave the loop as its stacked
        # outputs: a buffer threaded through the carry instead is stacked once per iteration
        # when an outer jax.checkpoint partial-evaluates this loop (memory quadratic in L)
        (h, buf), (ys, hs, secs) = lax.scan(step, (carry, buf), (jnp.arange(n_layers), xs))
        return (h, ys), (hs, tuple(ws for ws, _ in buf), secs)

    # static avals: the backward needs dtypes and shapes, not the values (saving the initial
    # carry would keep one more activation alive)
    carry_avals = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)), carry)

    @jax.custom_vjp
    def run(leaves, consts, carry, xs):
        return forward(leaves, consts, carry, xs, save=False)[0]

    def run_fwd(leaves, consts, carry, xs):
        out, saved = forward(leaves, consts, carry, xs, save=True)
        # named, so an enclosing jax.checkpoint keeps them rather than recomputing the loop
        saved = jax.tree.map(lambda v: checkpoint_name(v, LAYER_INPUTS), saved)
        return out, (leaves, consts, xs, saved)

    def run_bwd(res, cts):
        leaves, consts, xs, (hs, buf, secs) = res
        dy, dys = cts
        dy = jax.tree.map(cotangent, carry_avals, dy)
        # integer outputs' cotangents (float0) as float placeholders that slice like the rest
        dys = jax.tree.map(lambda d: jnp.zeros(d.shape, jnp.float32)
                           if d.dtype == jax.dtypes.float0 else d, dys)
        # tie the backward gathers to the cotangent: XLA can neither hoist them into the
        # forward pass nor merge them (CSE) with the forward's gathers of the same layers
        leaves, secs, dy = lax.optimization_barrier((leaves, secs, dy))
        float_consts = [is_float(c) for c in jax.tree.leaves(consts)]
        scatter_kw = dict(method=comm.scatter, block=comm.block, scale_dtype=comm.scale_dtype)

        def layer_vjp(ws, h_i, dy, x_i, dy_i, dconsts, nxt):
            """The layer's carry cotangent, its weights' gradient shards, its xs cotangent,
            and ``nxt`` (the prefetched weights), complete before the gradient leaves."""
            ws = tuple(as_operand(w, gather_dtype) for w in ws)
            out, vjp = jax.vjp(lambda wt, *a: apply(with_trained(ws, wt), *a),
                               [w for w, f in zip(ws, frozen, strict=True) if not f],
                               consts, h_i, x_i)  # frozen weights: no gradient computed
            ct = (jax.tree.map(cotangent, out[0], dy), jax.tree.map(cotangent, out[1], dy_i))
            if nxt is not None and comm.prefetch_before_vjp:
                # the prefetch arrives during the recomputed forward, not in flight across
                # the VJP, where the step peaks (Backend.prefetch_before_vjp: TPU)
                ct, nxt = lax.optimization_barrier((ct, nxt))
            dwt, dc, dh, dx_i = vjp(ct)
            dws = with_trained([None] * len(ws), [weight_grad(d) for d in dwt])
            if nxt is not None:
                # the prefetch is done before the reduce-scatter starts: libtpu runs one
                # asynchronous collective at a time and otherwise leaves the gather
                # synchronous (v5p:2x2x2, d_model 512, 4 layers, ring reduce-scatter: gather
                # bytes overlapped 44% -> 88%; no change on H100)
                dws, nxt = lax.optimization_barrier((dws, nxt))
            dc = [d for d, f in zip(jax.tree.leaves(dc), float_consts, strict=True) if f]
            dconsts = [acc + d for acc, d in zip(dconsts, dc, strict=True)]
            shards, pend = [], []  # pend: hpZ's first level, crossing nodes next iteration
            for dw, dim, b, lc in zip(dws, spec.dims, scattered, comms, strict=True):
                p = None
                if dw is None:  # frozen
                    pass
                elif dim is not None and not b and hpz:
                    dw, p = None, reduce_scatter(dw.astype(reduce_dtype), comm.axis_name,
                                                 dim=dim - 1, **scatter_kw)
                elif dim is not None and not b:
                    dw = scatter_levels(dw.astype(reduce_dtype), lc, dim=dim - 1)
                shards.append(dw)
                pend.append(p)
            for group, dims in zip(buckets, bucket_dims, strict=True) if joined else ():
                mine = reduce_scatter_bucket([dws[j].astype(reduce_dtype) for j in group],
                                             dims, comm.axis_name, **scatter_kw)
                if hpz:  # the second level, across nodes
                    mine = reduce_scatter_bucket(mine, dims, comm.node_axis, **scatter_kw)
                for j, dw in zip(group, mine, strict=True):
                    shards[j] = dw
            shards = [None if dw is None else dw.astype(g)
                      for dw, g in zip(shards, grad_dtypes, strict=True)]
            return dh, tuple(shards), dx_i, dconsts, nxt, tuple(pend)

        grad_dtypes = [None if f else grad_dtype(x, d, comm)
                       for x, d, f in zip(leaves, spec.dims, frozen, strict=True)]
        grads = tuple(None if g is None else to_home(jnp.zeros(leaf.shape, g))
                      for leaf, g in zip(leaves, grad_dtypes, strict=True))
        dconsts = [jnp.zeros_like(c) for c in jax.tree.leaves(consts) if is_float(c)]
        xs_leaves = jax.tree.leaves(xs)
        dxs = [jnp.zeros_like(x) for x in xs_leaves if is_float(x)]

        def across_nodes(pend):
            """hpZ's second level of the previous layer's gradients: issued at the start of
            an iteration, it crosses nodes while this layer computes (at the end of the
            iteration that made them it would wait, exposed, behind the first level: H100,
            d_model 512, reduce-scatter bytes overlapped 21% -> 100%)."""
            return [None if p is None else reduce_scatter(p, comm.node_axis, dim=dim - 1,
                                                          **scatter_kw)
                    for p, dim in zip(pend, spec.dims, strict=True)]

        def write(grads, shards, at):
            return tuple(g if s is None else lax.dynamic_update_index_in_dim(
                g, to_home(s.astype(g.dtype)), at, 0) for g, s in zip(grads, shards, strict=True))

        # the first iteration has no previous layer: it sends zeros across nodes (1/L of the
        # second level's bytes) and writes them at layer L-1, which the next overwrites
        nodes = lax.axis_size(comm.node_axis) if hpz else 1
        pend = tuple(
            jnp.zeros(tuple(d * nodes if j == dim - 1 else d
                            for j, d in enumerate(leaf.shape[1:])), reduce_dtype)
            if hpz and dim is not None and not b and not f else None
            for leaf, dim, b, f in zip(leaves, spec.dims, scattered, frozen, strict=True))

        def step(c, t):
            dy, buf, grads, dconsts, dxs, pend = c
            i = n_layers - 1 - t
            grads = write(grads, across_nodes(pend), jnp.minimum(i + 1, n_layers - 1))
            if k:  # the buffer starts with the forward's last prefetches: layers L-1 .. L-k
                # past layer 0 (the last k iterations) the prefetch re-gathers layer 0, unused
                ws, nxt = buf[0], regather_layer(leaves, secs, jnp.maximum(i - k, 0))
            else:
                ws, nxt = regather_layer(leaves, secs, i), None

            def at_i(tree):
                return jax.tree.map(lambda v: slice_layer(v, i), tree)

            h_i = restore(at_i(hs), carry_avals)
            dy, shards, dx_i, dconsts, nxt, pend = layer_vjp(ws, h_i, dy, at_i(xs),
                                                             at_i(dys), dconsts, nxt)
            if k:
                buf = (*buf[1:], nxt)
            grads = write(grads, shards, i)
            float_dx = [d for d, x in zip(jax.tree.leaves(dx_i), xs_leaves, strict=True)
                        if is_float(x)]
            dxs = [lax.dynamic_update_index_in_dim(acc, d, i, 0)
                   for acc, d in zip(dxs, float_dx, strict=True)]
            return (dy, buf, grads, dconsts, dxs, pend), None

        (dy, buf, grads, dconsts, dxs, pend), _ = lax.scan(
            step, (dy, buf, grads, dconsts, dxs, pend), jnp.arange(n_layers))
        grads = write(grads, across_nodes(pend), 0)
        grads = tuple(None if g is None else g.astype(leaf.dtype)
                      for g, leaf in zip(grads, leaves, strict=True))
        return (grads, refill(consts, dconsts), jax.tree.map(float_or_none, dy, carry_avals),
                refill(xs, dxs))

    run.defvjp(run_fwd, run_bwd)
    # named: an enclosing jax.checkpoint (the loss's, which re-gathers the non-Stack leaves)
    # saves the stack's output instead of running the forward loop again to rebuild it
    out = run(tuple(leaves_in), consts, carry, xs)
    return jax.tree.map(lambda v: checkpoint_name(v, LAYER_INPUTS), out)

