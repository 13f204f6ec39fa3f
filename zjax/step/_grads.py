"""Loss and gradients per replica, inside ``shard_map`` over ``data`` and ``model`` (and
``replica``: hybrid sharding all-reduces the reduced gradient shards over it once per step).

With a ``context`` axis each device holds its rows' whole token arrays (they are small) and the
model takes its share of every sequence (:func:`zjax.models.split_batch`); the sums are over
``context`` too, and ZeRO's collectives run over ``data`` x ``context``.

At stage 3 params enter as shards and are gathered over ``data`` on use; gradients leave
reduce-scattered (stage 2-3) or all-reduced over ``data``, in float32. Leaves split over
``model`` stay split: the model computes on its tensor-parallel slices with Megatron's operators
(:mod:`zjax.nn.tensor_parallel`), so the ZeRO collectives move ``1/model`` of each leaf. (A
region manual over ``data`` only, with ``model`` left to GSPMD, is what one would like; XLA then
all-gathers every weight over ``model`` at the region's entry, losing the split.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zjax.errors import ArgumentError
from zjax.models.trainable import Trainable
from zjax.offload import to_device
from zjax.partition import frozen_part, merge_parts, trained_part
from zjax.partition.gather import scatter_levels
from zjax.partition.plan import ShardPlan
from zjax.runtime.mesh import REPLICA, batch_axes, describe_batch_split, token_axes

__all__ = ["accumulate", "loss_parts", "metric_values", "reduce_grads", "sharded_grads",
           "sharded_loss", "sharded_score"]


def loss_parts(out) -> tuple[jax.Array, jax.Array, dict]:
    """``(loss_sum, count)`` or ``(loss_sum, count, {name: sum})`` -> the 3-tuple, float32.

    A step reports each metric sum over the batch divided by the count (a mean per loss
    token), but one named ``*_tokens`` as the sum itself (a count), and one named
    ``name@other`` as ``name``, divided by the sum ``other`` (:func:`metric_values`)."""
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise TypeError(
            "a zjax loss returns (loss_sum, count) or (loss_sum, count, metric_sums), "
            f"got {type(out).__name__}"
        )
    extra = dict(out[2]) if len(out) == 3 else {}
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(out[0]), f32(out[1]), {k: f32(v) for k, v in extra.items()}


def metric_values(extra: dict, count) -> dict:
    """A loss's metric sums over the batch as the step reports them: ``*_tokens`` as sums
    (counts of tokens), ``name@other`` as ``name``: its sum over the sum ``other`` (a mean
    over something else than the loss's count, e.g. GRPO's KL per completion token, whatever
    the loss averages over), the others divided by ``count`` (means per loss token)."""
    out = {}
    for key, value in extra.items():
        name, _, over = key.partition("@")
        if over:
            out[name] = value / jnp.maximum(extra[over], 1.0)
        else:
            out[key] = value if key.endswith("_tokens") else value / count
    return out


def reduce_grads(grads: Any, plan: ShardPlan, *, reduced_in_backward: bool) -> Any:
    """All-reduce / reduce-scatter the local grads over ``data``; results in float32.

    ``reduced_in_backward``: stage 3's sharded leaves were reduce-scattered by the gather
    primitive or the layer schedule already; they pass through.
    """
    rd = plan.reduce_dtype
    out = []
    for g, leaf in zip(jax.tree.leaves(grads), plan.leaves, strict=True):
        comm = plan.comm_of(leaf)  # an expert leaf: over the devices holding its experts
        if leaf.dim is not None and plan.zero.stage == 3 and reduced_in_backward:
            pass
        elif plan.params_on_host:  # a persistent leaf's local gradient, back from the host
            g = lax.psum(to_device(g).astype(rd), comm.axes)
        elif leaf.dim is not None and plan.zero.stage >= 2:
            g = scatter_levels(g.astype(rd), comm, dim=leaf.dim)
        else:
            g = lax.psum(g.astype(rd), comm.axes)
        out.append(g.astype(jnp.float32))
    return plan.tree(out)


def accumulate(fn: Callable[[Any], Any], batch: Any, micro_batches: int) -> Any:
    """The sum of ``fn`` over ``micro_batches`` equal splits of ``batch``'s leading axis.

    One micro-batch calls ``fn`` once; more run a ``lax.scan`` (cf. levanter's
    ``grad_accum``), so only one micro-batch's activations are live at a time.
    """
    if micro_batches == 1:
        return fn(batch)
    n = jax.tree.leaves(batch)[0].shape[0]
    if n % micro_batches:
        raise ArgumentError(
            "micro_batches", f"{micro_batches} micro-batches do not divide the batch of {n} "
            "rows given")
    mbs = jax.tree.map(lambda b: b.reshape(micro_batches, n // micro_batches, *b.shape[1:]),
                       batch)
    first = jax.tree.map(lambda b: b[0], mbs)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, first))
    total, _ = lax.scan(lambda acc, mb: (jax.tree.map(jnp.add, acc, fn(mb)), None), zeros, mbs)
    return total


def _local_grads(trainable: Trainable, plan: ShardPlan, micro_batches: int):
    """``(params, frozen, local batch) -> (grads, (loss_sum, count, extra))``, reduced over
    ``data``: the gradients of the trained leaves (``params``), the frozen ones only read."""
    reduce_each = plan.zero.stage >= 2  # sharded grads are reduced per micro-batch
    full, plan = plan, trained_part(plan)

    def loss_and_aux(p, f, b):
        loss_sum, count, extra = loss_parts(trainable.loss(merge_parts(full, p, f), b, full))
        return loss_sum, (loss_sum, count, extra)

    grad_fn = jax.grad(loss_and_aux, has_aux=True)

    def grads(params, frozen, batch):
        def one(mb):
            mb = prepared(trainable, full, params, frozen, mb)
            g, sums = grad_fn(params, frozen, mb)
            if reduce_each:
                g = reduce_grads(g, plan, reduced_in_backward=True)
            else:
                g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
            if plan.params_on_host and micro_batches > 1:
                g = to_device(g)  # accumulated on the device: adds of host buffers do not lower
            return g, sums

        _check_micro_batches(jax.tree.leaves(batch)[0].shape[0], plan, micro_batches)
        g, sums = accumulate(one, batch, micro_batches)
        if not reduce_each:
            g = reduce_grads(g, plan, reduced_in_backward=False)
        if plan.n_replica > 1:  # hybrid sharding: the groups' (sharded) sums added up
            rd = plan.reduce_dtype
            g = jax.tree.map(lambda x: lax.psum(x.astype(rd), REPLICA).astype(jnp.float32), g)
        return g, lax.psum(sums, token_axes(plan.mesh))

    return grads


def prepared(trainable: Trainable, plan: ShardPlan, params, frozen, batch):
    """``batch`` with what ``trainable.prepare`` adds (a preference loss's reference
    log-probs), complete before the loss starts (the barrier keeps the loss's forward from
    interleaving with it); ``batch`` itself without ``prepare``."""
    if trainable.prepare is None:
        return batch
    out = trainable.prepare(merge_parts(plan, params, frozen), batch, plan)
    return lax.optimization_barrier(out)


def _check_micro_batches(local: int, plan: ShardPlan, micro_batches: int) -> None:
    """The micro-batches must divide the rows of one batch shard; the message names every
    axis the global batch was split over (``expert`` and ``replica`` take rows too)."""
    if local % micro_batches:
        n = plan.n_batch
        raise ArgumentError(
            "micro_batches", f"{micro_batches} micro-batches do not divide the local batch of "
            f"{local} (the global batch of {local * n} over the "
            f"{describe_batch_split(plan.mesh)}); use a count that divides {local}, or a "
            f"global batch that is a multiple of {n * micro_batches}")


def sharded_grads(trainable: Trainable, plan: ShardPlan, mesh: Mesh, *,
                  micro_batches: int = 1) -> Callable:
    """``(params, frozen, global batch) -> (grads, (loss_sum, count, extra))`` over ``mesh``.

    Params and grads are laid out as ``plan`` says (``param_specs`` in, ``grad_specs`` out);
    the sums are over the whole global batch. ``params`` and the grads are the trained
    leaves, ``frozen`` the others (None when every leaf is trained).
    """
    trained, frozen = trained_part(plan), frozen_part(plan)
    return jax.shard_map(
        _local_grads(trainable, plan, micro_batches), mesh=mesh,
        in_specs=(trained.param_specs, frozen and frozen.param_specs, P(batch_axes(mesh))),
        out_specs=(trained.grad_specs, P()), axis_names=set(mesh.axis_names),
        check_vma=False)


def sharded_loss(trainable: Trainable, plan: ShardPlan, mesh: Mesh) -> Callable:
    """``(params, frozen, global batch) -> (mean loss, {metric: value})``: the same sharded
    forward, no gradients (the metrics as the step reports them)."""

    def local_loss(params, frozen, batch):
        batch = prepared(trainable, plan, params, frozen, batch)
        loss = trainable.loss(merge_parts(plan, params, frozen), batch, plan)
        loss_sum, count, extra = lax.psum(loss_parts(loss), token_axes(mesh))
        return loss_sum / count, metric_values(extra, count)

    trained, frozen = trained_part(plan), frozen_part(plan)
    return jax.shard_map(local_loss, mesh=mesh,
                         in_specs=(trained.param_specs, frozen and frozen.param_specs,
                                   P(batch_axes(mesh))),
                         out_specs=P(), axis_names=set(mesh.axis_names), check_vma=False)


def sharded_score(trainable: Trainable, plan: ShardPlan, mesh: Mesh) -> Callable:
    """``(params, frozen, global batch) -> [rows, ...]``: ``trainable.score`` of every row
    (float32, an array or a dict of them, split over the batch's axes like the rows)."""

    def local_score(params, frozen, batch):
        out = trainable.score(merge_parts(plan, params, frozen), batch, plan)
        return jax.tree.map(lambda x: x.astype(jnp.float32), out)

    trained, frozen = trained_part(plan), frozen_part(plan)
    rows = P(batch_axes(mesh))
    return jax.shard_map(local_score, mesh=mesh,
                         in_specs=(trained.param_specs, frozen and frozen.param_specs, rows),
                         out_specs=rows, axis_names=set(mesh.axis_names), check_vma=False)
