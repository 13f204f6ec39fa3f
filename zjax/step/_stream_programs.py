"""The compiled programs of the streamed step (parameters on NVMe): a model's loss as the
pieces :mod:`zjax.step._cuts` finds, each under ``shard_map`` over the whole mesh and ``jit``.

Per Stack call ``c``: ``layer_fwd(c)`` and ``layer_bwd(c)`` (one layer, its gradient shards
reduce-scattered by the gather's VJP); per segment ``k``: ``cut_fwd(k)`` / ``cut_bwd(k)`` up to
call ``k``, and ``tail`` (the loss, its gradients, its sums) past the last call. What a device
hands the next program (the residual stream, a Stack's ``context``) is per-device data of any
shape: it leaves a program as ``[devices, ...]`` over every mesh axis (a leading axis of one
per device) and enters the next the same way, so no layout is assumed for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.models.trainable import Trainable
from zjax.partition.plan import LeafPlan, ShardPlan
from zjax.runtime.mesh import REPLICA, batch_axes, token_axes
from zjax.step._cuts import StackCall, find_calls, layer_apply, segment
from zjax.step._grads import loss_parts

__all__ = ["Programs", "layer_spec"]


def _up(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)


def _down(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def layer_spec(leaf: LeafPlan) -> P:
    """The spec of one layer of a stacked leaf (its own shards)."""
    spec = tuple(leaf.spec) + (None,) * (len(leaf.shape) - len(leaf.spec))
    return P(*spec[1:])


def _reduced(grads: list, leaves: list[LeafPlan], plan: ShardPlan) -> list:
    """Gradients as the step keeps them (float32, own shards): a sharded leaf's came
    reduce-scattered from its gather's VJP; a persistent leaf's is summed here."""
    out = []
    for g, leaf in zip(grads, leaves, strict=True):
        if leaf.dim is None:
            g = lax.psum(g.astype(plan.reduce_dtype), plan.comm_of(leaf).axes)
        g = g.astype(jnp.float32)
        if plan.n_replica > 1:  # hybrid sharding: the groups' sums added up
            g = lax.psum(g.astype(plan.reduce_dtype), REPLICA).astype(jnp.float32)
        out.append(g)
    return out


class Programs:
    """The streamed step's programs for ``trainable`` under ``plan``.

    Args:
      trainable: an NNX model's trainable (``run_stacks``).
      plan: the shard plan (stage 3; every leaf trained).
      batch: the batch, abstract (the calls are found by tracing the loss once on it).
    """

    def __init__(self, trainable: Trainable, plan: ShardPlan, batch: Any):
        self.trainable, self.plan, mesh = trainable, plan, plan.mesh
        self.nonstack = [leaf for leaf in plan.leaves if not leaf.stacked]
        self.ns_specs = [leaf.spec for leaf in self.nonstack]
        self.dev = P(tuple(mesh.axis_names))
        self.rows = P(batch_axes(mesh))
        find = find_calls(trainable, plan)
        abstract = [jax.ShapeDtypeStruct(leaf.shape, plan.stored_param_dtype(leaf))
                    for leaf in self.nonstack]
        # tracing the loss once finds its Stack calls (the shapes are not needed)
        jax.eval_shape(self._map(find, (self.ns_specs, self.rows), P()), abstract, batch)
        self.calls: list[StackCall] = list(find.calls)

    def _map(self, fn: Callable, in_specs, out_specs) -> Callable:
        return jax.shard_map(fn, mesh=self.plan.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(self.plan.mesh.axis_names), check_vma=False)

    def _jit(self, fn: Callable, in_specs, out_specs, donate=()) -> Callable:
        mesh = self.plan.mesh
        sharding = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                              is_leaf=lambda s: isinstance(s, P))
        return jax.jit(self._map(fn, in_specs, out_specs), in_shardings=sharding(in_specs),
                       out_shardings=sharding(out_specs), donate_argnums=donate,
                       compiler_options=dict(self.plan.backend.compiler_options))

    def layer_args(self, c: int, batch: Any) -> tuple:
        """Call ``c``'s layer programs' arguments, abstract: ``(shards, h, context)``."""
        mesh, plan = self.plan.mesh, self.plan
        place = lambda shape, leaf, spec: jax.ShapeDtypeStruct(
            shape, plan.stored_param_dtype(leaf), sharding=NamedSharding(mesh, spec))
        nonstack = [place(leaf.shape, leaf, leaf.spec) for leaf in self.nonstack]
        outputs: list = []
        for k in range(c + 1):
            x, context = jax.eval_shape(self.cut_fwd(k), nonstack, batch, outputs)
            outputs.append(x)  # a Stack's output is like its input
        leaves = [plan.leaves[i] for i in self.calls[c].leaves]
        return [place(leaf.shape[1:], leaf, layer_spec(leaf)) for leaf in leaves], x, context

    def layer_specs(self, c: int) -> list[P]:
        return [layer_spec(self.plan.leaves[i]) for i in self.calls[c].leaves]

    @functools.cache  # noqa: B019 (one per call; the Programs live as long as the step)
    def layer_fwd(self, c: int) -> Callable:
        """``(layer shards, h, context, i) -> h`` of call ``c``."""
        apply = layer_apply(self.calls[c], self.plan)

        def fn(shards, h, context, i):
            return _up(apply(shards, _down(h), _down(context), i))

        return self._jit(fn, (self.layer_specs(c), self.dev, self.dev, P()), self.dev)

    @functools.cache  # noqa: B019
    def layer_bwd(self, c: int) -> Callable:
        """``(layer shards, h, context, i, cotangent) -> (gradient shards, h's cotangent)``:
        the layer run again from its saved input and differentiated."""
        call, plan = self.calls[c], self.plan
        apply = layer_apply(call, plan)
        leaves = [plan.leaves[i] for i in call.leaves]

        def fn(shards, h, context, i, ct):
            ctx = _down(context)
            _, vjp = jax.vjp(lambda s, x: apply(s, x, ctx, i), shards, _down(h))
            g, ct_h = vjp(_down(ct))
            return _reduced(g, leaves, plan), _up(ct_h)

        specs = self.layer_specs(c)
        return self._jit(fn, (specs, self.dev, self.dev, P(), self.dev), (specs, self.dev),
                         donate=(4,))

    @functools.cache  # noqa: B019
    def cut_fwd(self, k: int) -> Callable:
        """``(nonstack, batch, outputs) -> (x, context)``: the input of call ``k``."""
        cut = segment(self.trainable, self.plan, k)

        def fn(nonstack, batch, outputs):
            _, x, context = cut(nonstack, batch, _down(outputs))
            return _up((x, context))

        return self._jit(fn, (self.ns_specs, self.rows, self.dev), self.dev)

    @functools.cache  # noqa: B019
    def cut_bwd(self, k: int) -> Callable:
        """``(nonstack, batch, outputs, cotangent of x) -> (nonstack gradients, outputs'
        cotangents)`` of segment ``k``."""
        cut = segment(self.trainable, self.plan, k)

        def fn(nonstack, batch, outputs, ct):
            _, vjp = jax.vjp(lambda ns, o: cut(ns, batch, o)[1], nonstack, _down(outputs))
            g, ct_outputs = vjp(_down(ct))
            return _reduced(g, self.nonstack, self.plan), _up(ct_outputs)

        return self._jit(fn, (self.ns_specs, self.rows, self.dev, self.dev),
                         (self.ns_specs, self.dev))

    @functools.cache  # noqa: B019
    def tail(self, *, grads: bool) -> Callable:
        """``(nonstack, batch, outputs) -> (nonstack gradients, outputs' cotangents, sums)``
        with ``grads``, else ``sums``: the loss past the last call (gradients of the local
        loss sum: the step divides by the global count); ``sums`` ``(loss_sum, count,
        extra)`` over the whole batch."""
        tail = segment(self.trainable, self.plan, len(self.calls))
        axes = token_axes(self.plan.mesh)

        def loss(nonstack, batch, outputs):
            loss_sum, count, extra = loss_parts(tail(nonstack, batch, outputs)[1])
            return loss_sum, (loss_sum, count, extra)

        def fn(nonstack, batch, outputs):
            if not grads:
                return lax.psum(loss(nonstack, batch, _down(outputs))[1], axes)
            (g, ct), sums = jax.grad(loss, argnums=(0, 2), has_aux=True)(
                nonstack, batch, _down(outputs))
            return _reduced(g, self.nonstack, self.plan), _up(ct), lax.psum(sums, axes)

        out = (self.ns_specs, self.dev, P()) if grads else P()
        return self._jit(fn, (self.ns_specs, self.rows, self.dev), out)

