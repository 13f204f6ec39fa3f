"""The train step: pjit outside, explicit ZeRO inside.

1. ``jax.jit`` with in/out shardings from the :class:`~zjax.partition.ShardPlan`, state donated.
2. Inside, ``jax.shard_map`` manual over ``data`` and ``model`` runs loss and grads per replica
   on its local batch (micro-batched for gradient accumulation). At stage 3 params enter as
   shards and are gathered over ``data`` on use; gradients leave reduce-scattered (stage 2-3)
   or all-reduced over ``data``. Leaves the rules split over ``model`` stay split: the model
   computes on its tensor-parallel slices with Megatron's operators
   (:mod:`zjax.nn.tensor_parallel`), so the ZeRO collectives move ``1/model`` of each leaf.
   (A region manual over ``data`` only, with ``model`` left to GSPMD, is what one would like;
   XLA then all-gathers every weight over ``model`` at the region's entry, losing the split.)
3. The optax update runs outside the ``shard_map`` on sharded arrays, so global reductions
   (``clip_by_global_norm``) see the whole tree.
4. Offload (:mod:`zjax.offload`): state placed in host memory through the in/out shardings is
   brought to the device where the step uses it (per layer inside the schedule for
   ``offload_param`` at stage 3; for the update otherwise) and sent back; with
   ``update_on: host`` the update itself runs under ``compute_on("device_host")``.

Mixed precision: master params and optimizer state are float32. Stage 3 stores only the float32
master shards (the cast to ``gather_dtype`` happens at the gather). Stages 0-2 store a replicated
working copy in ``gather_dtype`` and, when that is narrower, a float32 master placed like the
optimizer state (sharded from stage 1); the new working copy is cast before it is all-gathered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.errors import ConfigError
from zjax.mesh import DATA, MODEL
from zjax.offload import (
    check_memory_kind,
    global_norm,
    on_host,
    on_host_compute,
    to_device,
    to_host,
)
from zjax.partition.config import ZeroConfig
from zjax.partition.gather import UINT as _UINT
from zjax.partition.gather import reduce_scatter
from zjax.partition.plan import ShardPlan, make_plan
from zjax.trainable import Trainable

__all__ = ["TrainState", "ZeroStep", "make_step"]


class TrainState(NamedTuple):
    """Everything a step updates.

    Attributes:
      step: number of optimizer steps taken.
      params: stored params (stage 3: float32 master shards; stages 0-2: working copy).
      master: float32 master params when stored apart from ``params``, else None.
      opt_state: the optax state.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any


def _loss_parts(out) -> tuple[jax.Array, jax.Array, dict]:
    """``(loss_sum, count)`` or ``(loss_sum, count, {name: sum})`` -> the 3-tuple, float32."""
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise TypeError(
            "a zjax loss returns (loss_sum, count) or (loss_sum, count, metric_sums), "
            f"got {type(out).__name__}"
        )
    extra = dict(out[2]) if len(out) == 3 else {}
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(out[0]), f32(out[1]), {k: f32(v) for k, v in extra.items()}


def _all_finite(tree) -> jax.Array:
    """Whether every float of ``tree`` is finite (no norm: squares overflow before values do)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.logical_and.reduce(jnp.stack(flags)) if flags else jnp.bool_(True)


def _cast_tree(tree, dtypes):
    return jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)


def _narrow_all_gather(master, dtypes, sharded, replicated):
    """Cast the new master on its shard, then all-gather the narrow working copy.

    The bits travel as unsigned integers: XLA would otherwise move the convert after the
    all-gather and move float32 (see :func:`zjax.partition.gather.all_gather`).
    """

    def one(x, dtype, s_in, s_out):
        narrow = x.astype(dtype)
        if not jnp.issubdtype(narrow.dtype, jnp.floating):
            return jax.lax.with_sharding_constraint(narrow, s_out)
        bits = lax.bitcast_convert_type(narrow, _UINT[narrow.dtype.itemsize])
        bits = jax.lax.with_sharding_constraint(bits, s_in)
        bits = jax.lax.with_sharding_constraint(bits, s_out)
        return lax.bitcast_convert_type(bits, narrow.dtype)

    return jax.tree.map(one, master, dtypes, sharded, replicated)


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
      evaluate: ``evaluate(params, batch) -> mean loss``, the same sharded forward, no update.
    """

    plan: ShardPlan
    state_shardings: TrainState
    abstract_state: TrainState
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], TrainState]
    step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    evaluate: Callable[[Any, Any], jax.Array]

    def check_batch(self, shape) -> None:
        """Raise ConfigError unless the data axis divides the global batch."""
        _check_batch(shape, self.plan.n_data)

    def put_batch(self, batch) -> jax.Array:
        """Place a global (host) batch split over the ``data`` axis."""
        self.check_batch(np.shape(batch))
        return jax.device_put(batch, self.batch_sharding)

    def lower(self, batch: jax.ShapeDtypeStruct):
        """Lower the step from abstract values only (nothing is allocated)."""
        self.check_batch(batch.shape)
        batch = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=self.batch_sharding)
        return self.step.lower(self.abstract_state, batch)


def _check_batch(shape, n_data: int) -> None:
    if not shape or shape[0] % n_data:
        size = shape[0] if shape else shape
        raise ConfigError(
            f"data.batch_size: the global batch of {size} is not divisible by the data axis "
            f"(mesh.data = {n_data}); use a multiple of {n_data}"
        )


def _reduce_grads(grads, plan: ShardPlan, *, reduced_in_backward: bool):
    """All-reduce / reduce-scatter the local grads over ``data``; results in float32."""
    rd = plan.reduce_dtype
    out = []
    for g, leaf in zip(jax.tree.leaves(grads), plan.leaves, strict=True):
        if leaf.dim is not None and plan.zero.stage == 3 and reduced_in_backward:
            pass  # the gather primitive / layer schedule reduce-scattered it already
        elif plan.params_on_host:  # a persistent leaf's local gradient, back from the host
            g = lax.psum(to_device(g).astype(rd), DATA)
        elif leaf.dim is not None and plan.zero.stage >= 2:
            g = reduce_scatter(g.astype(rd), DATA, dim=leaf.dim,
                               method=plan.scatter)
        else:
            g = lax.psum(g.astype(rd), DATA)
        out.append(g.astype(jnp.float32))
    return plan.tree(out)


def _check_offload(plan: ShardPlan, mesh: Mesh) -> None:
    zero = plan.zero
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

    Returns:
      A :class:`ZeroStep`.
    """
    if micro_batches < 1:
        raise ConfigError(f"train.grad_accum: must be >= 1, got {micro_batches}")
    abstract_params = jax.eval_shape(trainable.init, jax.random.key(0))
    plan = make_plan(abstract_params, zero, mesh, stacked=trainable.stacked,
                     logical_axes=trainable.logical_axes)
    _check_offload(plan, mesh)
    stored_dtypes = plan.tree(plan.stored_param_dtype(leaf) for leaf in plan.leaves)

    def init_fn(rng):
        master = trainable.init(rng)
        params = _cast_tree(master, stored_dtypes)
        return TrainState(jnp.zeros((), jnp.int32), params,
                          master if plan.has_master else None, tx.init(master))

    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    specs = TrainState(
        P(), plan.param_specs, plan.state_specs if plan.has_master else None,
        plan.opt_specs(tx, abstract.opt_state),
    )
    shardings = plan.shardings(specs)
    off_opt, off_param = plan.zero.offload_optimizer, plan.zero.offload_param
    # optax's step counts (scalars) stay in device memory: their bytes are nil, and an s32
    # count updated on the host and aliased back to a host buffer fails TPU's HLO verifier
    # ("Shape and memory space of the result ... must be the same as ... aliased parameter")
    opt_home = jax.tree.map(lambda a: plan.opt_on_host and a.ndim > 0, abstract.opt_state)
    shardings = shardings._replace(
        params=on_host(shardings.params, off_param.memory_kind) if plan.params_on_host
        else shardings.params,
        master=on_host(shardings.master, off_param.memory_kind)
        if plan.has_master and plan.master_on_host else shardings.master,
        opt_state=jax.tree.map(lambda s, h: s.with_memory_kind(off_opt.memory_kind) if h
                               else s, shardings.opt_state, opt_home),
    )
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    batch_sharding = NamedSharding(mesh, P(DATA))
    state_sharded = plan.shardings(plan.state_specs)
    param_sharded = plan.shardings(plan.param_specs)

    def local_grads(params, batch):
        n_local = batch.shape[0]
        if n_local % micro_batches:
            raise ConfigError(
                f"train.grad_accum: {micro_batches} micro-batches do not divide the local batch "
                f"of {n_local} (data.batch_size / mesh.data)"
            )
        reduce_each = plan.zero.stage >= 2  # sharded grads are reduced per micro-batch

        def loss_and_aux(p, b):
            loss_sum, count, extra = _loss_parts(trainable.loss(p, b, plan))
            return loss_sum, (loss_sum, count, extra)

        grad_fn = jax.grad(loss_and_aux, has_aux=True)

        def one(mb):
            g, (loss_sum, count, extra) = grad_fn(params, mb)
            if reduce_each:
                g = _reduce_grads(g, plan, reduced_in_backward=True)
            else:
                g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
            if plan.params_on_host and micro_batches > 1:
                g = to_device(g)  # accumulated on the device: adds of host buffers do not lower
            return g, (loss_sum, count, extra)

        if micro_batches == 1:
            g, sums = one(batch)
        else:
            mbs = batch.reshape(micro_batches, n_local // micro_batches, *batch.shape[1:])

            def body(acc, mb):
                return jax.tree.map(jnp.add, acc, one(mb)), None

            zeros = jax.eval_shape(one, mbs[0])
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zeros)
            (g, sums), _ = lax.scan(body, zeros, mbs)
        if not reduce_each:
            g = _reduce_grads(g, plan, reduced_in_backward=False)
        return g, lax.psum(sums, DATA)

    sharded_grads = jax.shard_map(
        local_grads,
        mesh=mesh,
        in_specs=(plan.param_specs, P(DATA)),
        out_specs=(plan.grad_specs, P()),
        axis_names={DATA, MODEL},
        check_vma=False,
    )

    update_on_host = plan.zero.offload_optimizer.update_on_host
    update_sharded = on_host(state_sharded, off_opt.memory_kind) if update_on_host \
        else state_sharded

    def update(grads, count, loss_sum, opt_state, target):
        """The optax update, on the device or (``update_on: host``) on the host.

        Returns the new params and optimizer state, the gradient and new-param norms, and
        whether the update is finite (loss, gradients, new params and optimizer state). With
        ``skip_nonfinite`` a non-finite update is dropped: the old state is returned.
        """
        move = to_host if update_on_host else to_device
        grads, count, loss_sum, opt_state, target = move(
            (grads, count, loss_sum, opt_state, target))
        with on_host_compute(update_on_host):
            grads = jax.tree.map(lambda g: g / count, grads)
            grads = jax.lax.with_sharding_constraint(grads, update_sharded)  # own shard
            updates, new_opt = tx.update(grads, opt_state, target)
            new = optax.apply_updates(target, updates)
            norm = global_norm(grads)  # not optax's: it cannot run on the host
            param_norm = global_norm(new)
            finite = jnp.isfinite(loss_sum) & jnp.isfinite(norm) & _all_finite((new, new_opt))
            if skip_nonfinite:
                keep = lambda n, o: jnp.where(finite, n, o)
                new, new_opt = jax.tree.map(keep, (new, new_opt), (target, opt_state))
        return new, new_opt, to_device((norm, param_norm, finite))

    def step_fn(state: TrainState, batch):
        _check_batch(batch.shape, plan.n_data)
        grads, (loss_sum, count, extra) = sharded_grads(state.params, batch)
        target = state.master if plan.has_master else state.params
        try:
            new, opt_state, (grad_norm, param_norm, finite) = update(
                grads, count, loss_sum, state.opt_state, target)
        except ValueError as e:
            if not (update_on_host and "memory_space" in str(e)):
                raise
            raise ConfigError(
                "zero.offload_optimizer.update_on: host: the optimizer's update mixes host and "
                f"device values ({str(e).splitlines()[0]}); optax transforms that create "
                "device constants cannot run on the host: use update_on: device") from None
        # offloaded state goes back to host memory; the rest stays on (or returns to) the device
        opt_state = jax.tree.map(lambda x, h: to_host(x) if h else to_device(x),
                                 opt_state, opt_home)
        new = to_host(new) if plan.master_on_host else to_device(new)
        if plan.has_master:
            master = jax.lax.with_sharding_constraint(new, shardings.master)
            params = _narrow_all_gather(to_device(master), stored_dtypes, state_sharded,
                                        param_sharded)
        else:
            master, params = None, _cast_tree(new, stored_dtypes)
        metrics = {"loss": loss_sum / count, "grad_norm": grad_norm, "param_norm": param_norm,
                   "finite": finite, "count": count,
                   **{k: v / count for k, v in extra.items()}}
        return TrainState(state.step + 1, params, master, opt_state), metrics

    def local_loss(params, batch):
        loss_sum, count, _ = lax.psum(_loss_parts(trainable.loss(params, batch, plan)), DATA)
        return loss_sum / count

    evaluate = jax.jit(
        jax.shard_map(local_loss, mesh=mesh, in_specs=(plan.param_specs, P(DATA)),
                      out_specs=P(), axis_names={DATA, MODEL}, check_vma=False),
        in_shardings=(shardings.params, batch_sharding),
    )
    init = jax.jit(init_fn, out_shardings=shardings)
    step = jax.jit(step_fn, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0,
                   compiler_options=dict(plan.backend.compiler_options))
    return ZeroStep(plan, shardings, abstract, batch_sharding, init, step, evaluate)
