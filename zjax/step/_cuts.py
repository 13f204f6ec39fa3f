"""A model's stage-3 loss cut at its ``Stack`` calls: the per-device pieces of a streamed step.

``Trainable.run_stacks`` runs the loss with a runner bound to every ``Stack``. Cutting there
gives, for a loss that calls its Stacks ``n`` times (a GPT once; DeepSeek's dense and mixture
stacks twice):

- segment ``k`` (``0 <= k < n``): from the batch (and the outputs of calls ``0..k-1``) to the
  input of call ``k``, with what the call hands each layer (``context``);
- the last segment: from the batch and every call's output to the loss;
- each call's layer: ``layer_fn(layer_params, h, context, index)``, one layer of the Stack.

A segment is the loss traced with runners that return the given outputs for the calls before
``k`` and stop the trace at call ``k`` (an exception caught inside the same trace, carrying the
call's input): the leaves outside the Stacks are gathered on access as in the one-program step,
the Stacks' own leaves are never read (zeros of their shard shapes stand in, dropped by XLA).
Everything here runs inside ``shard_map``; :mod:`zjax.step._streamed` compiles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zjax.errors import ConfigError
from zjax.models.trainable import Trainable
from zjax.partition.gather import gather
from zjax.partition.plan import LeafPlan, ShardPlan, path_str

__all__ = ["StackCall", "find_calls", "layer_apply", "segment"]


class StackCall(NamedTuple):
    """One call of a ``Stack`` in the loss.

    Attributes:
      path: the Stack's path in the model.
      layer_fn: ``layer_fn(layer_params, h, context=None, index=None)``: one layer.
      treedef: the structure of one layer's params (a pure dict).
      leaves: the plan's index of each of its leaves, in ``treedef``'s order.
      n_layers: the Stack's depth.
      indexed: the layers take their index (``layer=i``).
    """

    path: str
    layer_fn: Callable
    treedef: Any
    leaves: tuple[int, ...]
    n_layers: int
    indexed: bool


class _Cut(Exception):  # a control-flow signal, not an error
    """Stops a trace at a Stack call, carrying its input and what it hands each layer."""

    def __init__(self, x: Any, context: Any):
        super().__init__("stack call")
        self.x, self.context = x, context


def _with_placeholders(nonstack: list, plan: ShardPlan) -> Any:
    """The params tree the loss takes: ``nonstack`` (the leaves outside the Stacks, in plan
    order) and zeros of each stacked leaf's shard shape (never read)."""
    it, out = iter(nonstack), []
    for leaf in plan.leaves:
        out.append(jnp.zeros(_shard_shape(leaf, plan), leaf.dtype) if leaf.stacked
                   else next(it))
    return plan.tree(out)


def _shard_shape(leaf: LeafPlan, plan: ShardPlan) -> tuple[int, ...]:
    shape = list(leaf.shape)
    if leaf.dim is not None:
        shape[leaf.dim] //= plan.shards_of(leaf)
    if leaf.model_dim is not None:
        shape[leaf.model_dim] //= plan.n_model
    if leaf.expert_dim is not None:
        shape[leaf.expert_dim] //= plan.n_expert
    return tuple(shape)


def find_calls(trainable: Trainable, plan: ShardPlan) -> Callable[[list, Any], Any]:
    """A per-device function ``(nonstack, batch) -> loss`` whose tracing fills ``fn.calls``
    with the loss's :class:`StackCall` s, in call order. Each call returns its input (a
    Stack's output is like its input), so the trace also gives the loss's output shapes."""
    if trainable.run_stacks is None:
        raise ConfigError("zero.offload_param.device: nvme streams the layers of a model's "
                          "Stacks (an NNX model, zjax.from_nnx); this loss is a pytree loss, "
                          "with no Stack to stream: use zero.offload_param.device: host")
    by_path = {leaf.path: i for i, leaf in enumerate(plan.leaves)}
    calls: list[StackCall] = []

    def make_runner(path: str, stack):
        def run(layer_fn, params, x, context=None, index=None):
            del index  # the stream passes each layer its own
            flat, treedef = jax.tree_util.tree_flatten_with_path(params)
            leaves = tuple(by_path[f"{path}/layers/{path_str(p)}"] for p, _ in flat)
            for i in leaves:
                if plan.leaves[i].dim == 0:
                    raise ConfigError(f"zero.offload_param.device: nvme: {plan.leaves[i].path} "
                                      "is sharded over its layers; the stream reads one layer "
                                      "of every device's shard")
            calls.append(StackCall(path, layer_fn, treedef, leaves, stack.n_layers,
                                   stack.indexed))
            return x

        return run

    def fn(nonstack, batch):
        return trainable.run_stacks(_with_placeholders(nonstack, plan), batch, plan,
                                    make_runner)

    fn.calls = calls
    return fn


def segment(trainable: Trainable, plan: ShardPlan, k: int) -> Callable:
    """Segment ``k``, per device: ``(nonstack, batch, outputs) -> ("cut", x, context)`` at call
    ``k``, or ``("loss", out)`` past the last call (``outputs``: calls ``0..k-1``'s)."""

    def fn(nonstack, batch, outputs):
        seen = [0]

        def make_runner(path, stack):
            def run(layer_fn, params, x, context=None, index=None):
                j = seen[0]
                seen[0] += 1
                if j < k:
                    return outputs[j]
                raise _Cut(x, context)

            return run

        try:
            out = trainable.run_stacks(_with_placeholders(nonstack, plan), batch, plan,
                                       make_runner)
        except _Cut as cut:
            return "cut", cut.x, cut.context
        return "loss", out

    return fn


def layer_apply(call: StackCall, plan: ShardPlan) -> Callable:
    """One layer of ``call``, per device: ``(layer shards, h, context, i) -> h``; each shard
    (the layer's slice of a stacked leaf's shard) gathered on use, so its gradient leaves
    reduce-scattered."""
    leaves = [plan.leaves[i] for i in call.leaves]

    def fn(shards, h, context, i):
        whole = [gather(x, dim=None if leaf.dim is None else leaf.dim - 1,
                        comm=plan.comm_of(leaf)) for x, leaf in zip(shards, leaves, strict=True)]
        params = jax.tree.unflatten(call.treedef, whole)
        return call.layer_fn(params, h, context, i if call.indexed else None)

    return fn

