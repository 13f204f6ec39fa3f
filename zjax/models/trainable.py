"""What zjax trains: an init function, a loss over params, and which leaves are stacked layers.

Two ways in:

- :func:`from_nnx`: an NNX model (its ``Stack`` layers run through the scheduled layer scan at
  stage 3; every other sharded leaf is gathered on access where the model is merged).
- :func:`from_pytree`: any params pytree plus a pure loss (plain JAX, Flax Linen, Equinox, a
  third-party Flax model), no change to the model's code: at stage 3 the gather-on-use
  transform (:mod:`zjax.partition.transform`) gathers each layer where it is used, its scans
  over stacked layers run as scheduled loops.

A loss returns ``(sum of per-example losses, count)``; zjax divides by the global count so the
sharded run equals the single-device one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from zjax.errors import NotGatheredError
from zjax.nn import Stack, bind_runners, iter_stacks
from zjax.partition import Comm, kept_scan
from zjax.partition.gather import REMAT_POLICY, gather_tree, join_gathers
from zjax.partition.plan import ShardPlan, path_str
from zjax.partition.rows import Rows
from zjax.partition.schedule import ScheduleSpec, scheduled_scan
from zjax.partition.transform import LeafSpec, gather_on_use
from zjax.runtime.mesh import MODEL

__all__ = ["Trainable", "from_nnx", "from_pytree"]

Params = Any
LossOut = tuple[jax.Array, jax.Array]


@dataclasses.dataclass(frozen=True)
class Trainable:
    """A model as zjax sees it.

    Attributes:
      init: ``init(rng) -> params`` (float32 master params; pure, traceable).
      loss: ``loss(params, batch, plan) -> (loss_sum, count)``: ``params`` as stored by the plan
        (shards at stage 3), run inside the step's ``shard_map``.
      stacked: predicate on a leaf path: True where dimension 0 stacks layers.
      logical_axes: a leaf's logical dimension names by path (None when it names none), or
        None for a model without names; the rules of :mod:`zjax.partition.rules` split some
        of them over the ``model`` axis.
      frozen: predicate on a leaf path: True for leaves that are not trained (the base
        weights under adapters): no gradient, no optimizer state, stored in the dtype
        ``init`` gives them (a quantized weight's integer codes too).
      codec: for a quantized frozen base, the :class:`zjax.lora.BaseCodec` saying which
        frozen leaves are stored quantized: a loader gives them as float weights of their
        ``logical_shape`` and the step ``encode`` s them; None otherwise.
      dropout_seed: for a model with dropout (on adapters' inputs), the seed of its masks:
        the training step adds per-row keys to each batch (``dropout_keys``,
        :func:`zjax.lora.row_keys` of this seed and the step); None: no dropout.
      frozen_from: for frozen leaves that are a function of the trained ones at the start
        (a preference loss's reference: a copy of the starting weights),
        ``frozen_from(trained) -> frozen`` (both as :mod:`zjax.partition`'s parts): a run's
        start then gives the trained leaves only; None otherwise.
      score: ``score(params, batch, plan) -> [rows, ...]`` per-row values, an array or a
        dict of them (the reference log-probs a preference run precomputes, an RL run's old
        and reference log-probs of each token), run like ``loss``; None: none.
      prepare: ``prepare(params, batch, plan) -> batch``: what the loss reads besides the
        data, computed from the params before the loss and outside its differentiation
        (a preference loss's reference log-probs: never recomputed in the backward, its
        working set freed before the loss's forward); None: the batch as it is.
      decoder: ``decoder(params) -> model``: the model to generate with (``init_cache``,
        ``decode``) from whole params as :attr:`init` gives them (trained and frozen leaves
        merged); None for a model that cannot generate (a pytree loss).
      run_stacks: for an NNX model, ``run_stacks(shards, batch, plan, make_runner)``: the
        stage-3 loss (inside ``shard_map``) with ``make_runner(path, stack)`` bound to every
        ``Stack``, the leaves outside them gathered on access; the Stacks' own leaves are
        not read (a runner brings the layers): what the streamed step
        (``zero.offload_param.device: nvme``) cuts at its Stacks. None for a pytree loss.
    """

    init: Callable[[jax.Array], Params]
    loss: Callable[[Params, Any, ShardPlan], LossOut]
    stacked: Callable[[str], bool] = lambda path: False
    logical_axes: Callable[[str], tuple[str | None, ...] | None] | None = None
    frozen: Callable[[str], bool] = lambda path: False
    codec: Any = None
    dropout_seed: int | None = None
    frozen_from: Callable[[Params], Params] | None = None
    score: Callable[[Params, Any, ShardPlan], jax.Array] | None = None
    prepare: Callable[[Params, Any, ShardPlan], Any] | None = None
    decoder: Callable[[Params], Any] | None = None
    run_stacks: Callable[[Params, Any, ShardPlan, Callable], LossOut] | None = None


def _suspects(plan: ShardPlan, message: str) -> list[str]:
    """Sharded leaves whose local shard size appears in an error message, best matches first."""
    numbers = {int(n) for n in re.findall(r"\d+", message)}
    scored = []
    for leaf in plan.leaves:
        if leaf.dim is None:
            continue
        local = leaf.shape[leaf.dim] // plan.shards_of(leaf)
        score = (local in numbers) + (leaf.shape[leaf.dim] in numbers)
        shard = list(leaf.shape)
        shard[leaf.dim] = local
        scored.append((-score, leaf.path, f"{leaf.path} (shard {tuple(shard)} of {leaf.shape})"))
    return [text for _, _, text in sorted(scored)]


def _shape_guard(fn: Callable[..., LossOut], plan: ShardPlan) -> Callable[..., LossOut]:
    """Turn XLA's shape errors from un-gathered shards into an error naming the leaf."""

    @functools.wraps(fn)
    def guarded(params, *args):
        try:
            return fn(params, *args)
        except (TypeError, ValueError) as e:
            if plan.zero.stage != 3 or "shape" not in str(e).lower():
                raise
            suspects = _suspects(plan, str(e))
            raise NotGatheredError(
                f"the model failed on a shape mismatch under ZeRO stage 3 ({e}). A sharded "
                f"parameter was probably used without being gathered (e.g. a Stack's params "
                f"used outside the Stack). Most likely: {'; '.join(suspects[:5])}"
            ) from e

    return guarded


def from_pytree(
    init: Callable[[jax.Array], Params],
    loss_fn: Callable[[Params, Any], LossOut],
    *,
    logical_axes: Callable[[str], tuple[str | None, ...] | None] | None = None,
) -> Trainable:
    """Train any params pytree with a pure ``loss_fn(params, batch) -> (sum, count)``.

    At stage 3 the loss runs through :func:`zjax.partition.transform.gather_on_use`: a scan
    over stacked params gathers each iteration's layer inside the loop (prefetching
    ``zero.prefetch_layers`` ahead), unrolled layers (named by the first numbered component of
    their paths, ``h/3/...``) are gathered per segment and gathered again in the backward, a
    leaf used in several layers (tied embeddings) is gathered once and its gradients summed
    before one reduce-scatter. A loss with no layer structure trains whole, with a
    :class:`~zjax.errors.GatherFallbackWarning`. ``logical_axes`` names a leaf's dimensions by
    path for tensor parallelism (the loss then computes on local slices, see
    :mod:`zjax.nn.tensor_parallel`). At stages 0-2 with ZeRO-R's activation settings its
    layer scans run as the same loops, with nothing to gather.
    """

    def loss(params, batch, plan: ShardPlan):
        keeping = _input_keeping(plan)
        if plan.zero.stage < 3:
            return (_kept_inputs(loss_fn, plan) if any(keeping.values()) else loss_fn)(
                params, batch)

        def prefetch(layer_elements: int, n_layers: int) -> int:
            return plan.zero.prefetch_depth(layer_elements=layer_elements, n_layers=n_layers)

        run = gather_on_use(loss_fn, [LeafSpec(leaf.path, leaf.dim,
                                               axes=plan.comm_of(leaf).axis_name)
                                      for leaf in plan.leaves],
                            prefetch=prefetch, join=plan.join_gathers,
                            bucket=plan.bucket_layer_gathers, comm=plan.comm, **keeping)
        # no _shape_guard: the transform gathers every leaf before the loss sees it, so a
        # shape error here is the loss's own (traced at whole shapes) or a zjax bug; saying
        # "a shard used without being gathered" would misname either
        return jax.checkpoint(run, policy=REMAT_POLICY)(params, batch)

    return Trainable(init=init, loss=loss, logical_axes=logical_axes)


def from_nnx(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    loss_fn: Callable[[nnx.Module, Any], LossOut],
) -> Trainable:
    """Train an NNX model built by ``make_model(rngs)`` with ``loss_fn(model, batch)``.

    Params are the model's ``nnx.Param`` state as a pure dict. Leaves of every
    :class:`zjax.nn.Stack` are stacked; the rest are gathered on access.
    """
    abstract = nnx.eval_shape(lambda: make_model(nnx.Rngs(0)))
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("zjax trains models whose state is nnx.Param only; found other state")
    prefixes = tuple(f"{path}/layers/" for path, _ in iter_stacks(abstract))
    names = {  # Flax's logical axis names (``out_sharding`` metadata) by leaf path
        "/".join(map(str, path)): tuple(var.get_metadata().get("out_sharding") or ()) or None
        for path, var in nnx.iter_graph(abstract) if isinstance(var, nnx.Param)
    }

    fp8 = frozenset(  # the weights an FP8 matmul reads (metadata fp8=True)
        "/".join(map(str, path)) for path, var in nnx.iter_graph(abstract)
        if isinstance(var, nnx.Param) and var.get_metadata().get("fp8"))

    rows = frozenset(  # the embedding tables only take_rows reads (metadata rows=True)
        "/".join(map(str, path)) for path, var in nnx.iter_graph(abstract)
        if isinstance(var, nnx.Param) and var.get_metadata().get("rows"))

    def stacked(path: str) -> bool:
        return path.startswith(prefixes)

    def init(rng):
        model = make_model(nnx.Rngs(params=rng))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def loss(params, batch, plan: ShardPlan):
        if plan.zero.stage < 3:
            model, keeping = nnx.merge(graphdef, params), _input_keeping(plan)
            if any(keeping.values()):  # ZeRO-R over whole params
                bind_runners(model, lambda path, stack: functools.partial(
                    kept_scan, offload=keeping["offload_inputs"],
                    partition_axis=keeping["partition_inputs"]))
            return loss_fn(model, batch)
        run = lambda shards, batch: _nnx_stage3_loss(graphdef, loss_fn, shards, batch, plan,
                                                     fp8, rows)
        return jax.checkpoint(_shape_guard(run, plan), policy=REMAT_POLICY)(params, batch)

    def run_stacks(shards, batch, plan: ShardPlan, make_runner):
        model = nnx.merge(graphdef, _gather_non_stacked(shards, plan))
        bind_runners(model, make_runner)
        return loss_fn(model, batch)

    decoder = functools.partial(nnx.merge, graphdef)
    return Trainable(init=init, loss=loss, stacked=stacked, logical_axes=names.get,
                     decoder=decoder, run_stacks=run_stacks)


def _gather_non_stacked(shards, plan: ShardPlan, rows: frozenset[str] = frozenset()):
    """Every leaf outside a Stack gathered once; stack leaves stay shards for the schedule;
    the embedding tables in ``rows`` (metadata ``rows=True``) handed over as :class:`Rows`
    where their gather is a plain one along the rows."""
    xs = jax.tree.leaves(shards)
    looked_up = [leaf.path in rows and _plain_rows(leaf, plan.comm_of(leaf))
                 for leaf in plan.leaves]
    # XLA:CPU gathers a looked-up table too, joined (a gather made where a lookup falls
    # back would run beside the stack's loops); elsewhere a lookup that falls back gathers
    out = [x if leaf.stacked or (r and not plan.join_gathers)
           else gather_tree(x, leaf.dim, comm=plan.comm_of(leaf))
           for x, leaf, r in zip(xs, plan.leaves, looked_up, strict=True)]
    if plan.join_gathers:  # XLA:CPU: none may overlap the stack's loops
        out = join_gathers(out, [not leaf.stacked and leaf.dim is not None
                                 for leaf in plan.leaves])
    out = [Rows(x, plan.comm_of(leaf), leaf.shape[0], o if plan.join_gathers else None)
           if r else o for x, o, leaf, r in zip(xs, out, plan.leaves, looked_up, strict=True)]
    return plan.tree(out)


def _plain_rows(leaf, comm: Comm) -> bool:
    """Whether a table's rows can be looked up where they live: sharded along its rows over
    one level of devices, in device memory, not quantized nor split by tensor parallelism."""
    return (leaf.dim == 0 and leaf.model_dim is None and comm.node_axis is None
            and not comm.quantize and not comm.from_host)


def _input_keeping(plan: ShardPlan) -> dict:
    """How the layer schedule keeps saved layer inputs (``zero.offload_activations``,
    ``zero.partition_activations``): ``ScheduleSpec``'s fields."""
    split = plan.zero.partition_activations and plan.n_model > 1
    return dict(offload_inputs=plan.zero.offload_activations,
                partition_inputs=MODEL if split else None)


def _kept_inputs(loss_fn, plan: ShardPlan):
    """Stages 0-2 under ZeRO-R: the loss's layer scans, over whole params, become loops that
    keep their saved inputs as ``zero.offload_activations`` / ``partition_activations`` say
    (the gather-on-use transform with nothing to gather or cast)."""
    return gather_on_use(loss_fn, [LeafSpec(leaf.path, None, layered=True)
                                   for leaf in plan.leaves],
                         prefetch=lambda *_: 0, comm=Comm(axis_name=plan.comm.axis_name),
                         **_input_keeping(plan))


def _stack_runner(plan: ShardPlan, fp8: frozenset[str] = frozenset()):
    """``runner(path, stack)``: the scheduled scan that runs the Stack at ``path``; the leaves
    in ``fp8`` gathered in FP8 with ``zero.fp8_gather``."""
    by_path = {leaf.path: leaf for leaf in plan.leaves}

    def runner(path: str, stack: Stack):
        _, state = nnx.split(stack.layers)
        flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
        layer_leaves = [by_path[f"{path}/layers/{path_str(p)}"] for p, _ in flat]
        # what one device gathers per layer: 1/model of the leaves tensor parallelism splits
        per_layer = sum(leaf.size // leaf.shape[0]
                        // (plan.n_model if leaf.model_dim is not None else 1)
                        for leaf in layer_leaves)
        spec = ScheduleSpec(
            dims=tuple(leaf.dim for leaf in layer_leaves),
            prefetch=plan.zero.prefetch_depth(layer_elements=per_layer,
                                              n_layers=stack.n_layers),
            bucket=plan.bucket_layer_gathers,
            comm=plan.comm,
            axes=tuple(plan.comm_of(leaf).axis_name for leaf in layer_leaves),
            frozen=tuple(leaf.frozen for leaf in layer_leaves),
            fp8=tuple(plan.zero.fp8_gather and leaf.path in fp8 for leaf in layer_leaves),
            **_input_keeping(plan),
        )
        return functools.partial(scheduled_scan, spec=spec)

    return runner


def _nnx_stage3_loss(graphdef, loss_fn, shards, batch, plan: ShardPlan, fp8=frozenset(),
                     rows=frozenset()):
    """The NNX model's loss at stage 3: its Stacks run as scheduled scans, the tables in
    ``rows`` looked up where their rows live."""
    model = nnx.merge(graphdef, _gather_non_stacked(shards, plan, rows))
    bind_runners(model, _stack_runner(plan, fp8))
    return loss_fn(model, batch)
