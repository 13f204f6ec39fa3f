"""Gather on use: ZeRO-3 for any JAX loss, scheduled layer by layer.

:func:`gather_on_use` traces ``loss(params, *args)`` with the params at their gathered shapes
(``jax.make_jaxpr``), inlines the calls that only group code (``jit``, ``closed_call``,
``checkpoint``) and rewrites the program so that no device holds more than a few layers of
gathered weights:

- **Layer scans.** A ``scan`` whose per-iteration inputs (``xs``) include stacked parameter
  leaves (``lax.scan``, Flax ``nn.scan``, an Equinox filtered scan) runs as
  :func:`~zjax.partition.schedule.scheduled_loop`: each iteration's slice gathered inside the
  loop with the stack's prefetch depth, re-gathered in the backward, its gradient
  reduce-scattered at once.
- **Unrolled layers.** The rest of the program is cut into segments at the first use of each
  layer's parameters; the layer is the leaf path up to its first component ending in a number
  (``h/3/attn/c_attn/kernel`` -> ``h/3``, ``layers_3/Dense_0/kernel`` -> ``3``). Each segment
  gathers the leaves only it uses, saves only its inputs, and gathers them again for its
  backward once its outputs' cotangents exist (:func:`_remat`), so the backward holds one
  segment's weights at a time.
- **Shared leaves.** A leaf used in several segments (tied embeddings) is gathered once for
  the whole loss, so its gradients are summed before one reduce-scatter.
- **Views.** Casts, reshapes and transposes of a leaf (``jax.tree.map(lambda p:
  p.astype(bf16), params)`` at the top of a model) are deferred to where their result is used,
  so they do not make every leaf's first use the program's first line.

A slice of a stacked leaf taken outside a scan (a Python loop indexing ``stacked[i]``) is a
use of the whole leaf in every segment that takes one: it is gathered whole, once.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax

from zjax.errors import GatherFallbackWarning
from zjax.partition._program import (
    CannotRewrite,
    Env,
    LeafSpec,
    Lit,
    Program,
    analyse,
    layer_of,
    needs,
    scan_split,
)
from zjax.partition.gather import Comm, gather, join_gathers
from zjax.partition.schedule import ScheduleSpec, scheduled_loop

__all__ = ["LeafSpec", "gather_on_use", "layer_of"]

_DEFAULT_COMM = Comm()


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _tie(shards: list, values: list) -> list:
    """``shards`` through one barrier with the float ``values``: their gathers cannot start
    before those values exist."""
    floats = [v for v in values if _is_float(v)]
    if not shards or not floats:
        return shards
    return list(lax.optimization_barrier((list(shards), floats))[0])


def gather_on_use(
    fn: Callable[..., Any],
    leaves: Sequence[LeafSpec],
    *,
    prefetch: Callable[[int, int], int],
    comm: Comm = _DEFAULT_COMM,
    join: bool = False,
    bucket: bool = False,
    offload_inputs: bool = False,
    partition_inputs: str | None = None,
) -> Callable[..., Any]:
    """Wrap ``fn(params, *args)`` to run on shards, each leaf gathered where it is used.

    Args:
      fn: the loss, written for whole params; pure.
      leaves: per flattened leaf of ``params`` (``jax.tree.leaves`` order): path and dim.
      prefetch: ``prefetch(layer_elements, n_layers)``: a layer scan's prefetch depth.
      comm: the axis, dtypes, host residence and reduce-scatter method of the gathers.
      join: order every segment's gathers after its inputs (XLA:CPU's collectives).
      bucket: a layer scan with prefetch moves each layer's leaves as one bucket
        (``ScheduleSpec.bucket``).
      offload_inputs, partition_inputs: how a layer scan keeps its saved layer inputs
        (``ScheduleSpec``: in host memory; split over a mesh axis).

    Returns:
      ``wrapped(shards, *args)`` (call it inside ``shard_map``; wrap it in
      ``jax.checkpoint(policy=REMAT_POLICY)`` so the shared leaves are re-gathered for the
      backward rather than kept). A program the analysis does not read
      (:class:`~zjax.partition._program.CannotRewrite`: it names the construct) runs with
      every leaf gathered up front, with one :class:`~zjax.errors.GatherFallbackWarning`
      per loss and reason; any other error in the analysis or the rewrite is raised.
    """
    comms = ScheduleSpec(dims=tuple(spec.dim for spec in leaves),
                         axes=tuple(spec.axes for spec in leaves)).comms(comm)

    def gather_leaf(x, leaf: int):
        return gather(x, dim=leaves[leaf].dim, comm=comms[leaf])

    def wrapped(shards, *args):
        flat, treedef = jax.tree.flatten(shards)
        if len(flat) != len(leaves):
            raise ValueError(f"{len(leaves)} leaf specs for {len(flat)} parameter leaves")
        full = [_gathered_aval(x, spec.dim, lax.axis_size(c.axes), comm.gather_dtype)
                for x, spec, c in zip(flat, leaves, comms, strict=True)]
        abstract_args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a),
                                                                    jnp.result_type(a)), args)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
            jax.tree.unflatten(treedef, full), *abstract_args)
        try:
            prog = analyse(closed, leaves)
        except CannotRewrite as e:  # the one documented refusal: correct, unscheduled
            _warn_once(fn, str(e))
            full_params = [gather_leaf(x, i) for i, x in enumerate(flat)]
            if join:
                full_params = join_gathers(full_params, [s.dim is not None for s in leaves])
            return fn(jax.tree.unflatten(treedef, full_params), *args)
        _warn_if_flat(prog, leaves)
        outs = _execute(prog, flat, jax.tree.leaves(args), leaves, gather_leaf, prefetch,
                        comm, join=join,
                        layer_opts=dict(bucket=bucket, offload_inputs=offload_inputs,
                                        partition_inputs=partition_inputs))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


# the reasons already given per loss: a loss is traced more than once (the step, the
# evaluation, a retrace), and one warning per reason says it
_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warn_once(fn: Callable, reason: str) -> None:
    """Warn that ``fn``'s gathers are not scheduled, naming ``reason``, once per ``fn``."""
    try:
        seen = _WARNED.setdefault(fn, set())
    except TypeError:  # not weakly referable (a builtin): warn every time
        seen = set()
    if reason in seen:
        return
    seen.add(reason)
    warnings.warn(GatherFallbackWarning(
        f"zjax cannot schedule the model's gathers layer by layer: the loss holds {reason}; "
        "every parameter is gathered at the start of the loss instead (correct, but the whole "
        "model is materialised on every device)"), stacklevel=3)


def _gathered_aval(x, dim: int | None, size: int, gather_dtype) -> jax.ShapeDtypeStruct:
    shape = list(jnp.shape(x))
    if dim is not None:
        shape[dim] *= size
    dtype = jnp.result_type(x)
    if gather_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        dtype = np.dtype(gather_dtype)
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _warn_if_flat(prog: Program, leaves: Sequence[LeafSpec]) -> None:
    """Warn when the loss shows no layers: its memory is then not bounded by a layer."""
    sharded = [s for s in leaves if s.dim is not None]
    if len(sharded) < 2 or any(seg.kind == "scan" for seg in prog.segments):
        return
    holding = sum(1 for seg in prog.segments if seg.leaves)
    if holding <= 1:
        why = f"its {len(sharded)} sharded parameters are all first used in one place"
    elif all(layer_of(s.path) == s.path for s in sharded):
        why = (f"no scan runs over stacked parameters and no parameter path names a numbered "
               f"layer (e.g. {sharded[0].path!r}); its parameters are gathered in "
               f"{holding} groups, by first use")
    else:
        return
    warnings.warn(GatherFallbackWarning(
        f"zjax found no layer structure in the loss: {why}. Memory is not bounded by one "
        "layer's weights"), stacklevel=3)


def _gather_top(prog: Program, shards: list, leaves, gather_leaf, join: bool) -> dict:
    """Leaf index -> value of what the whole loss holds: persistent leaves (cast) and shared
    ones (gathered once)."""
    top: dict = {i: gather_leaf(shards[i], i) for i, spec in enumerate(leaves)
                 if spec.dim is None}
    up_front = list(prog.shared)
    if join and any(seg.kind == "scan" for seg in prog.segments):
        # XLA:CPU runs a loop's collectives unordered against those outside it: a segment's
        # gathers (or its gradients' reduce-scatters) could meet the loop's. As for a Stack
        # (zjax.models.trainable.from_nnx), every leaf outside the loops is then gathered up front,
        # all joined: their cotangents are released together, after the loops' backward.
        for seg in prog.segments:
            if seg.kind == "plain":
                up_front += sorted(seg.leaves)
                seg.leaves = set()
    shared = [gather_leaf(shards[i], i) for i in up_front]
    top.update(zip(up_front, join_gathers(shared) if join else shared, strict=True))
    return top


def _later(prog: Program) -> list[set]:
    """Per segment, the keys it must hand on: read by a later segment, or returned."""
    later: list[set] = [set() for _ in prog.segments]
    wanted = {a for a in prog.outs if not isinstance(a, Lit)}
    for s in range(len(prog.segments) - 1, -1, -1):
        later[s] = set(wanted)
        for op in prog.segments[s].ops:
            wanted |= needs(op, prog)
    return later


def _tie_at(prog: Program, shards: list, depth_of, join: bool) -> dict:
    """Segment -> the plain segments whose gathers are tied to its inputs.

    A segment's gathers may start once the inputs of the segment ``depth`` before it are
    ready (the prefetch window; ``depth_of(largest segment bytes, segments)``); XLA:CPU
    (``join``) needs them after the segment's own inputs.
    """
    plain = [s for s, seg in enumerate(prog.segments) if seg.kind == "plain" and seg.leaves]
    largest = max((sum(int(np.prod(shards[i].shape)) for i in prog.segments[s].leaves)
                   for s in plain), default=0)
    depth = 0 if join or not plain else depth_of(largest, len(plain))
    tie_at: dict = {}
    for n, s in enumerate(plain):
        tie_at.setdefault(plain[max(0, n - depth)], []).append(s)
    return tie_at


def _execute(prog: Program, shards: list, args: list, leaves, gather_leaf, prefetch,
             comm: Comm, *, layer_opts: dict, join: bool) -> list:
    values = dict(zip(prog.arg_keys, args, strict=True))
    top = _gather_top(prog, shards, leaves, gather_leaf, join)
    later = _later(prog)
    tie_at = _tie_at(prog, shards, lambda size, n: prefetch(
        size * lax.axis_size(comm.axes), n), join)
    tied: dict = {}
    env = Env(prog, values, top)
    for s, seg in enumerate(prog.segments):
        defined = {k for op in seg.ops for k in op.outs if k is not None}
        inputs = sorted({k for op in seg.ops for k in needs(op, prog)} - defined)
        exports = sorted(defined & later[s])
        in_vals = [env.read(k) for k in inputs]
        for t in tie_at.get(s, []):
            tied[t] = _tie([shards[i] for i in sorted(prog.segments[t].leaves)], in_vals)
        private = sorted(seg.leaves)
        if seg.kind == "scan":
            outs = _run_scan(prog, seg, dict(zip(inputs, in_vals, strict=True)), top,
                             {i: shards[i] for i in private},
                             {i: shards[i] for _, i in seg.stacked}, gather_leaf, leaves,
                             prefetch, comm, layer_opts)
            env.values.update((k, outs[k]) for k in exports)
            continue
        used = sorted({prog.root[a] for op in seg.ops for a in op.ins
                       if not isinstance(a, Lit) and a in prog.root} & set(top))
        run = functools.partial(_run_plain, prog, seg, inputs, exports, private, used,
                                gather_leaf)
        outs = _remat(run, tied.get(s, [shards[i] for i in private]),
                      [top[i] for i in used], in_vals)
        env.values.update(zip(exports, outs, strict=True))
    return [env.read(a) for a in prog.outs]


def _remat(f, shards: list, leaf_vals: list, in_vals: list) -> list:
    """``f(shards, leaf_vals, in_vals)``, recomputed (its shards gathered again) for the
    backward once the cotangents of its outputs are ready; only its inputs are saved.

    ``jax.checkpoint`` would save the same, but its recomputation depends only on the saved
    inputs, so XLA may hoist every segment's re-gather to the start of the backward (XLA:CPU
    does: temp then grows by a gathered layer per layer). Tying the re-gather to the
    cotangents keeps one segment's weights alive at a time, as the scheduled scan does."""

    @jax.custom_vjp
    def call(shards, leaf_vals, in_vals):
        return f(shards, leaf_vals, in_vals)

    def fwd(shards, leaf_vals, in_vals):
        return f(shards, leaf_vals, in_vals), (shards, leaf_vals, in_vals)

    def bwd(res, cts):
        shards, leaf_vals, in_vals = res
        floats = [i for i, c in enumerate(cts) if c.dtype != jax.dtypes.float0]
        # the inputs pass the barrier too: the recomputation must not be merged (CSE) with
        # the forward, which would keep the forward's intermediates alive instead
        shards, leaf_vals, in_vals, tied = lax.optimization_barrier(
            (shards, leaf_vals, in_vals, [cts[i] for i in floats]))
        cts = list(cts)
        for i, c in zip(floats, tied, strict=True):
            cts[i] = c
        _, vjp = jax.vjp(f, shards, leaf_vals, in_vals)
        return jax.tree.map(lambda g: None if g.dtype == jax.dtypes.float0 else g, vjp(cts))

    call.defvjp(fwd, bwd)
    return call(shards, leaf_vals, in_vals)


def _run_plain(prog, seg, inputs, exports, private, used, gather_leaf, shards, leaf_vals,
               in_vals):
    leaf_values = dict(zip(used, leaf_vals, strict=True))
    leaf_values.update({i: gather_leaf(x, i) for i, x in zip(private, shards, strict=True)})
    env = Env(prog, dict(zip(inputs, in_vals, strict=True)), leaf_values)
    for op in seg.ops:
        env.run(op)
    return [env.values[k] for k in exports]


def _run_scan(prog, seg, inputs: dict, top, private_shards, stacked_shards, gather_leaf,
              leaves, prefetch, comm: Comm, layer_opts: dict) -> dict:
    (op,) = seg.ops
    leaf_values = dict(top)
    leaf_values.update({i: gather_leaf(x, i) for i, x in private_shards.items()})
    env = Env(prog, inputs, leaf_values)
    n_consts, n_carry = scan_split(op)
    start = n_consts + n_carry
    sliced = dict(seg.stacked)  # xs position -> leaf
    vals = [None if pos - start in sliced else env.read(a)
            for pos, a in enumerate(op.ins)]
    consts, carry = vals[:n_consts], vals[n_consts:start]
    xs = [v for pos, v in enumerate(vals[start:]) if pos not in sliced]
    order = sorted(sliced)  # xs positions of the sliced leaves
    want = [op.eqn.invars[start + pos].aval.dtype for pos in order]
    body_jaxpr = op.eqn.params["jaxpr"]
    n_layers = op.eqn.params["length"]
    layer_elements = sum(int(np.prod(op.eqn.invars[start + pos].aval.shape[1:]))
                         for pos in order)

    def body(params_i, consts_, carry_, xs_i):
        it = iter(xs_i)
        ps = dict(zip(order, params_i, strict=True))
        xs_full = [ps[pos].astype(want[order.index(pos)]) if pos in ps else next(it)
                   for pos in range(len(op.ins) - start)]
        out = jcore.jaxpr_as_fun(body_jaxpr)(*consts_, *carry_, *xs_full)
        return list(out[:n_carry]), list(out[n_carry:])

    spec = ScheduleSpec(
        dims=tuple(leaves[sliced[pos]].dim for pos in order),
        prefetch=prefetch(layer_elements, n_layers),
        comm=comm.resolved(want[0]),
        axes=tuple(leaves[sliced[pos]].axes for pos in order),
        **layer_opts,
    )
    carry_out, ys = scheduled_loop(body, [stacked_shards[sliced[pos]] for pos in order],
                                   consts, carry, xs, spec=spec)
    return {k: v for k, v in zip(op.outs, [*carry_out, *ys], strict=True) if k is not None}
