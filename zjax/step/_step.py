"""The train step: pjit outside, explicit ZeRO inside.

1. ``jax.jit`` with in/out shardings from the :class:`~zjax.partition.ShardPlan`, state donated
   (:mod:`zjax.step._state`).
2. Inside, ``jax.shard_map`` manual over ``data`` and ``model`` runs loss and grads per replica
   on its local batch, micro-batched for gradient accumulation (:mod:`zjax.step._grads`).
3. The optax update runs outside the ``shard_map`` on sharded arrays, so global reductions
   (``clip_by_global_norm``) see the whole tree; offloaded state comes to the device for it and
   goes back (:mod:`zjax.step._update`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.errors import ArgumentError, ConfigError
from zjax.lora import row_keys
from zjax.models import DROPOUT_KEYS
from zjax.models.trainable import Trainable
from zjax.offload import check_memory_kind, on_host
from zjax.partition import frozen_part, merge_parts, split_parts, trained_part
from zjax.partition.config import ZeroConfig
from zjax.partition.plan import ShardPlan, make_plan
from zjax.runtime.mesh import batch_axes, describe_batch_split
from zjax.step._grads import metric_values, sharded_grads, sharded_loss, sharded_score
from zjax.step._nvme import NvmeOptimizer, nvme_parts
from zjax.step._nvme_io import NvmeStorage
from zjax.step._rollout import make_rollout
from zjax.step._state import TrainState, make_init, state_from, state_layout
from zjax.step._storage import MemoryStorage, StateStorage
from zjax.step._stream_parts import streamed_parts
from zjax.step._update import apply_update, host_update_errors, store

__all__ = ["ZeroStep", "make_step"]


@dataclasses.dataclass(frozen=True)
class ZeroStep:
    """A compiled-on-demand ZeRO train step and everything needed to place its state.

    Attributes:
      plan: the per-leaf placement.
      state_shardings: ``TrainState`` of ``NamedSharding`` (the jit's in/out shardings).
      abstract_state: ``TrainState`` of ``ShapeDtypeStruct`` with those shardings.
      batch_sharding: how the global batch is laid out (split over ``data``).
      init: ``init(rng) -> TrainState``, created directly into its shards (``zero.Init``).
      step: ``step(state, batch) -> (state, metrics)``; ``state`` is donated. The metrics:
        ``loss``, ``grad_norm``, ``param_norm`` (of the new float32 params), ``finite`` (the
        update's loss, gradients, new params and optimizer state are all finite), ``count``
        and the loss's own.
      evaluate: ``evaluate(params, batch, frozen=None) -> mean loss``, the same sharded
        forward, no update (``frozen``: the state's frozen leaves, if any).
      evaluate_metrics: ``evaluate_metrics(params, batch, frozen=None) -> (mean loss,
        {metric: value})``: :attr:`evaluate` with the loss's own metrics, as the step reports
        them (one compile serves both).
      derived_frozen: the frozen leaves are made from the trained ones at the start
        (``Trainable.frozen_from``): :attr:`from_params` and :attr:`params_target` are the
        trained leaves'; ``frozen_init(rng)`` and ``frozen_of(trained)`` give the frozen
        leaves alone, placed (a resume's); else those two are None.
      score: with ``Trainable.score``, ``score(params, batch, frozen=None) -> [rows, ...]``
        float32 per-row values (a preference run's precomputed reference log-probs, an RL
        run's per-token log-probs); else None.
      rollout: with ``Trainable.decoder``, the jitted generation from the state's params
        (:func:`zjax.step._rollout.make_rollout`: gathered once, in ``zero.gather_dtype``);
        else None.
      from_params: ``from_params(params) -> TrainState`` at step 0 from given params (a
        fine-tune's start), placed as :attr:`params_shardings` says; they are donated.
      params_shardings: where :attr:`from_params` takes its params: float32 shards placed as
        the master copy (split over ``data`` from stage 1).
      canonical: the checkpoint's form of the state, abstract: ``{"step", "params" (float32
        master), "opt_state"}``, the same whatever the stage, mesh or offload.
      from_base: with frozen leaves (adapters over a base), ``from_base(base, start)`` at
        step 0: the base given as :attr:`base_target` says (donated; a quantized base's
        linear weights as float weights, quantized here), the trained leaves initialised
        from ``start``, an RNG key, or ``start`` itself, the trained leaves (float32 on the
        host: adapters read from a file); else None (also where the frozen leaves are
        made from the trained ones, ``Trainable.frozen_from``: :attr:`from_params` then
        takes the trained leaves only).
      base_target: the frozen leaves :attr:`from_base` takes, abstract (float32, placed), or
        None.
      nvme: with ``zero.offload_optimizer.device: nvme``, the
        :class:`~zjax.step._nvme.NvmeOptimizer` that owns the swap files (the state's master
        and optimizer state live there, not in :attr:`abstract_state`); else None.
    """

    plan: ShardPlan
    state_shardings: TrainState
    abstract_state: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    evaluate: Callable[[Any, Any], jax.Array]
    from_params: Callable[[Any], TrainState]
    params_shardings: Any
    canonical: dict | None = None
    nvme: NvmeOptimizer | None = None
    from_base: Callable[[Any, jax.Array], TrainState] | None = None
    base_target: Any = None
    evaluate_metrics: Callable | None = None
    score: Callable | None = None
    derived_frozen: bool = False
    frozen_init: Callable | None = None
    frozen_of: Callable | None = None
    rollout: Callable | None = None

    def close(self) -> None:
        """Release what the step holds outside the state (NVMe swap files: removed)."""
        if self.nvme is not None:
            self.nvme.close()

    @property
    def storage(self) -> StateStorage:
        """The state as canonical leaves, wherever it lives (what checkpoints read and
        write): in device or host memory, or in the NVMe optimizer's swap files."""
        if self.nvme is not None:
            return NvmeStorage(self.canonical, self.nvme)
        return MemoryStorage(self.canonical, trained_part(self.plan).has_master,
                             self.abstract_state.params)

    @property
    def params_target(self) -> Any:
        """The params :attr:`from_params` takes, abstract: float32 ``ShapeDtypeStruct`` with
        :attr:`params_shardings` (an Orbax restore target, or the shapes to fill)."""
        plan = trained_part(self.plan) if self.derived_frozen else self.plan
        return jax.tree.map(
            lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=s),
            plan.tree(plan.leaves), self.params_shardings)

    def check_batch(self, shape) -> None:
        """Raise ConfigError unless the data axis divides the global batch."""
        _check_batch(shape, self.plan)

    def put_batch(self, batch) -> jax.Array:
        """Place a global (host) batch (an array, or a mapping of them: packed documents)
        split over the ``data`` axis."""
        self.check_batch(_batch_shape(batch))
        return jax.device_put(batch, self.batch_sharding)

    def lower(self, batch: jax.ShapeDtypeStruct):
        """Lower the step from abstract values only (nothing is allocated)."""
        self.check_batch(_batch_shape(batch))
        batch = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype,
                                                            sharding=self.batch_sharding), batch)
        return self.step.lower(self.abstract_state, batch)


def _with_dropout_keys(batch, seed: int | None, step: jax.Array, sharding: NamedSharding):
    """``batch`` with its rows' dropout keys (a model with dropout: ``seed`` not None)."""
    if seed is None:
        return batch
    batch = dict(batch) if isinstance(batch, Mapping) else {"tokens": batch}
    keys = row_keys(seed, step, _batch_shape(batch)[0])
    return {**batch, DROPOUT_KEYS: jax.lax.with_sharding_constraint(keys, sharding)}


def _batch_shape(batch) -> tuple:
    """The shape of a batch's first array (a mapping's arrays share the batch dimension)."""
    return np.shape(jax.tree.leaves(batch)[0])


def _check_batch(shape, plan: ShardPlan) -> None:
    """The batch's rows must split evenly over the mesh axes that take them (``batch``
    names all of them, with the keys that sized a derived ``data`` axis)."""
    n_batch = plan.n_batch
    if not shape or shape[0] % n_batch:
        size = shape[0] if shape else shape
        raise ArgumentError(
            "batch", f"the global batch of {size} is not divisible by the "
            f"{describe_batch_split(plan.mesh)}; use a multiple of {n_batch}")


def _check_offload(plan: ShardPlan, mesh: Mesh) -> None:
    zero = plan.zero
    if plan.opt_on_nvme and zero.offload_param.enabled and zero.stage < 3:
        raise ConfigError(
            f"zero.offload_param.device: host at stage {zero.stage} offloads the float32 "
            "master, which zero.offload_optimizer.device: nvme already keeps on NVMe; set "
            "offload_param.device: none (or use stage 3, where it offloads the working params)")
    if zero.offload_param.enabled and zero.stage < 3 and not plan.has_master:
        raise ConfigError(
            f"zero.offload_param.device: host at stage {zero.stage} offloads the float32 master, "
            f"but with zero.gather_dtype {zero.gather_dtype} the stored params are the master "
            "(replicated, used whole by every step); use stage 3 or a 16-bit gather_dtype")
    refused = plan.backend.no_host_update
    if zero.offload_optimizer.update_on_host and refused:
        raise ConfigError(
            f"zero.offload_optimizer.update_on: host cannot compile on {plan.backend.platform}: "
            f"{refused.reason} ({refused.link}); use update_on: device (the optimizer state "
            "still lives in host memory between steps)")
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        if section.enabled:
            check_memory_kind(mesh, section.memory_kind, key=f"zero.{key}.pin_memory")


def make_step(
    trainable: Trainable,
    tx: optax.GradientTransformation,
    *,
    zero: ZeroConfig,
    mesh: Mesh,
    micro_batches: int = 1,
    skip_nonfinite: bool = False,
    clip_norm: float | None = None,
) -> ZeroStep:
    """Build the sharded init and train step for ``trainable`` under ``zero`` on ``mesh``.

    Args:
      trainable: the model (:func:`zjax.from_nnx` / :func:`zjax.from_pytree`).
      tx: the optax optimizer; it updates float32 master params.
      zero: the ZeRO config section.
      mesh: a ``(data, model)`` mesh.
      micro_batches: gradient accumulation steps per optimizer step (the local batch is split
        into this many micro-batches).
      skip_nonfinite: drop an update whose loss, gradients or new params are not finite (the
        state stays as it was; the metric ``finite`` is False). Without it the update is
        applied and ``finite`` reports it.
      clip_norm: scale the mean gradient down to this global norm before ``tx`` (optax's
        ``clip_by_global_norm``, taken out of the transform: with
        ``zero.offload_optimizer.device: nvme`` the transform must be elementwise).

    Returns:
      A :class:`ZeroStep`.
    """
    if micro_batches < 1:
        raise ArgumentError("micro_batches", f"must be >= 1, got {micro_batches}")
    plan = make_plan(jax.eval_shape(trainable.init, jax.random.key(0)), zero, mesh,
                     stacked=trainable.stacked, logical_axes=trainable.logical_axes,
                     frozen=trainable.frozen)
    mesh = plan.mesh  # hpZ splits the data axis into (node, data)
    trained = trained_part(plan)  # what is updated (all of plan but an adapter's base)
    _check_offload(trained, mesh)
    batch_sharding = NamedSharding(mesh, P(batch_axes(mesh)))
    grads_fn = sharded_grads(trainable, plan, mesh, micro_batches=micro_batches)
    params_shardings = plan.shardings(plan.state_specs)
    if zero.offload_param.nvme:  # parameters on NVMe: the streamed step
        return ZeroStep(plan, **streamed_parts(trainable, tx, plan, micro_batches=micro_batches,
                                               clip_norm=clip_norm, skip_nonfinite=skip_nonfinite))
    if plan.opt_on_nvme:
        return _nvme_step(trainable, tx, plan, grads_fn, batch_sharding, params_shardings,
                          clip_norm=clip_norm, skip_nonfinite=skip_nonfinite)
    init = make_init(trainable.init, tx, plan)
    layout = state_layout(plan, tx, init)
    shardings = layout.shardings

    def step_fn(state: TrainState, batch):
        _check_batch(_batch_shape(batch), plan)
        batch = _with_dropout_keys(batch, trainable.dropout_seed, state.step, batch_sharding)
        grads, (loss_sum, count, extra) = grads_fn(state.params, state.frozen, batch)
        with host_update_errors(trained):
            updated = apply_update(tx, grads, count, loss_sum, state.opt_state,
                                   state.master if trained.has_master else state.params,
                                   plan=trained, skip_nonfinite=skip_nonfinite,
                                   clip_norm=clip_norm)
        metrics = {"loss": loss_sum / count, "grad_norm": updated.grad_norm,
                   "param_norm": updated.param_norm, "finite": updated.finite, "count": count,
                   **metric_values(extra, count)}
        return store(state.step, updated, layout, trained)._replace(frozen=state.frozen), \
            metrics

    evaluation = _evaluation(trainable, plan, mesh, (shardings.params, shardings.frozen,
                                                       batch_sharding))
    step = jax.jit(step_fn, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0,
                   compiler_options=dict(plan.backend.compiler_options))
    from_params, params_shardings, start = _from_params(trainable, tx, plan,
                                                        params_shardings, shardings)
    a = layout.abstract
    canonical = {"step": a.step, "params": a.master if trained.has_master else a.params,
                 "opt_state": a.opt_state}
    return ZeroStep(plan, shardings, layout.abstract, batch_sharding,
                    jax.jit(init, out_shardings=shardings), step, evaluation["evaluate"],
                    from_params, params_shardings, canonical, **start,
                    **{k: v for k, v in evaluation.items() if k != "evaluate"})


def _evaluation(trainable: Trainable, plan: ShardPlan, mesh: Mesh, in_shardings: tuple
                ) -> dict[str, Any]:
    """``{evaluate, evaluate_metrics, score, rollout}``: the sharded forward's mean loss, with
    its metrics, the per-row score (None without ``Trainable.score``) and the generation
    from the state (None without ``Trainable.decoder``)."""
    forward = jax.jit(sharded_loss(trainable, plan, mesh), in_shardings=in_shardings)
    score = None
    if trainable.score is not None:
        scored = jax.jit(sharded_score(trainable, plan, mesh), in_shardings=in_shardings)
        score = lambda params, batch, frozen=None: scored(params, frozen, batch)
    return {"evaluate": lambda params, batch, frozen=None: forward(params, frozen, batch)[0],
            "evaluate_metrics": lambda params, batch, frozen=None: forward(params, frozen,
                                                                           batch),
            "score": score, "rollout": make_rollout(trainable, plan, mesh, in_shardings)}


def _from_params(trainable: Trainable, tx, plan: ShardPlan, params_shardings: Any,
                 shardings: TrainState) -> tuple[Callable, Any, dict[str, Any]]:
    """``(from_params, its params' shardings, {from_base, base_target, derived_frozen})``:
    the state at step 0 from given params; with ``Trainable.frozen_from``, from the trained
    leaves only (the frozen ones made from them)."""
    make = state_from(tx, plan)
    if trainable.frozen_from is None:
        from_params = jax.jit(make, in_shardings=(params_shardings,), out_shardings=shardings,
                              donate_argnums=0)
        return from_params, params_shardings, _from_base(trainable, plan, make,
                                                         params_shardings, shardings)
    trained_shardings = split_parts(plan, params_shardings)[0]

    def from_trained(trained):
        return make(merge_parts(plan, trained, trainable.frozen_from(trained)))

    from_params = jax.jit(from_trained, in_shardings=(trained_shardings,),
                          out_shardings=shardings, donate_argnums=0)
    # the frozen leaves alone (a resume: the checkpoint holds the trained ones), never a
    # second optimizer state beside the restored one
    frozen_init = jax.jit(lambda rng: split_parts(plan, trainable.init(rng))[1],
                          out_shardings=shardings.frozen)
    frozen_of = jax.jit(trainable.frozen_from, in_shardings=(trained_shardings,),
                        out_shardings=shardings.frozen)
    return from_params, trained_shardings, {"derived_frozen": True,
                                            "frozen_init": frozen_init, "frozen_of": frozen_of}


def _from_base(trainable: Trainable, plan: ShardPlan, from_params: Callable,
               params_shardings: Any, shardings: TrainState) -> dict[str, Any]:
    """``{from_base, base_target}``: ``from_base(base, rng) -> TrainState`` from a frozen
    base given as ``base_target`` says (float32, placed) and the trained leaves (adapters)
    initialised from ``rng``; empty when no leaf is frozen. The init's base part
    is never computed (XLA drops what no output uses). A quantized base's linear weights
    come as float weights and are quantized here (``trainable.codec``)."""
    frozen = frozen_part(plan)
    if frozen is None:
        return {}
    codec = trainable.codec
    coded = [codec is not None and codec.encodes(leaf.path) for leaf in frozen.leaves]
    target = []
    for leaf, s, c in zip(frozen.leaves, jax.tree.leaves(split_parts(plan, params_shardings)[1]),
                          coded, strict=True):
        shape = codec.logical_shape(leaf.shape) if c else leaf.shape
        try:
            s.shard_shape(shape)
        except ValueError:  # a float weight's dimensions that the packed one's split skips
            s = NamedSharding(s.mesh, P())
        target.append(jax.ShapeDtypeStruct(shape, np.float32, sharding=s))

    def encoded(base):
        return frozen.tree(codec.encode(x) if c else x
                           for x, c in zip(jax.tree.leaves(base), coded, strict=True))

    def from_rng(base, rng):
        trained, _ = split_parts(plan, trainable.init(rng))
        return from_params(merge_parts(plan, trained, encoded(base)))

    def from_trained(base, trained):
        return from_params(merge_parts(plan, trained, encoded(base)))

    target = frozen.tree(target)
    shard = jax.tree.map(lambda a: a.sharding, target)
    # the float base is donated, unless quantized here (no output could reuse its buffers)
    donate = 0 if codec is None else ()
    by_rng = jax.jit(from_rng, in_shardings=(shard, None), out_shardings=shardings,
                     donate_argnums=donate)
    by_trained = jax.jit(from_trained, out_shardings=shardings, donate_argnums=donate,
                         in_shardings=(shard, split_parts(plan, params_shardings)[0]))

    def from_base(base, start):
        """``start``: an RNG key (the trained leaves initialised from it) or the trained
        leaves themselves (``lora.init_adapter``'s adapters)."""
        is_key = isinstance(start, jax.Array) and jax.dtypes.issubdtype(
            start.dtype, jax.dtypes.prng_key)
        return by_rng(base, start) if is_key else by_trained(base, start)

    return {"from_base": from_base, "base_target": target}


def _nvme_step(trainable: Trainable, tx: optax.GradientTransformation, plan: ShardPlan,
               grads_fn, batch_sharding: NamedSharding, params_shardings, *,
               clip_norm: float | None, skip_nonfinite: bool) -> ZeroStep:
    """The step with the master and optimizer state on NVMe (:mod:`zjax.step._nvme`)."""
    if trained_part(plan) is not plan:
        raise ConfigError("zero.offload_optimizer.device: nvme does not train beside frozen "
                          "weights (adapters over a base, lora.rank > 0, or a preference "
                          "reference); use device: cpu or none")
    param_shardings = plan.shardings(plan.param_specs)
    if plan.params_on_host:
        param_shardings = on_host(param_shardings, plan.zero.offload_param.memory_kind)
    parts = nvme_parts(trainable.init, tx, plan, grads_fn, param_shardings, batch_sharding,
                       clip_norm=clip_norm, skip_nonfinite=skip_nonfinite)
    evaluation = _evaluation(trainable, plan, plan.mesh,
                             (param_shardings, None, batch_sharding))
    return ZeroStep(plan, parts.shardings, parts.abstract, batch_sharding, parts.init,
                    parts.step, evaluation.pop("evaluate"), parts.from_params,
                    params_shardings, parts.canonical, parts.engine, **evaluation)
