"""The train step with the optimizer on NVMe (ZeRO-Infinity's third tier).

The device holds only the working params (stage 3: the sharded leaves in ``gather_dtype``).
One step is:

1. a compiled program: loss and gradients as the in-memory step computes them, the mean
   gradient laid out as each device's own shard (float32), its global norm;
2. on the host, :class:`~zjax.offload.nvme.StreamingOptimizer` walks every shard by
   sub-groups: reads master and moments from the swap files (each process its own, named by
   its index), fetches the gradient slice from the device, runs the optax update, writes the
   state back and sends the new master values, cast, to the devices
   (:mod:`zjax.step._nvme_engine`).

Global-norm clipping is the step's (``clip_norm``): the norm is computed on the device before
the stream and scales every gradient; the optax transform itself must be elementwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.errors import ConfigError
from zjax.offload import global_norm
from zjax.offload.nvme import StreamingOptimizer, check_elementwise
from zjax.partition.plan import ShardPlan
from zjax.step._grads import metric_values
from zjax.step._nvme_engine import (
    LeafShards,
    ParamBuilder,
    Slices,
    leaf_shards,
    local_value,
    shard_data,
)
from zjax.step._state import TrainState

__all__ = ["NvmeOptimizer", "NvmeParts", "NvmeStep", "StateMap", "clip_scale", "nvme_abstract",
           "nvme_layout", "nvme_parts"]

KEY = "zero.offload_optimizer.nvme_path"


class StateMap(NamedTuple):
    """Where each leaf of the optax state lives: ``("m<k>", leaf)`` for a per-parameter leaf
    (swap-file part ``m<k>`` of param leaf ``leaf``), ``("scalar", i)`` for a step count."""

    treedef: Any
    entries: list[tuple[str, int]]


def _state_map(tx: optax.GradientTransformation, master: Any) -> StateMap:
    """Match the optax state of the whole tree with its state for one flat vector."""
    params = jax.tree.leaves(master)
    flat, treedef = jax.tree.flatten(jax.eval_shape(tx.init, master))
    template = jax.tree.leaves(jax.eval_shape(tx.init, jax.ShapeDtypeStruct((7,), np.float32)))
    entries, i, n_moment, n_scalar = [], 0, 0, 0
    for t in template:
        if t.shape == (7,):
            for j, p in enumerate(params):
                if i >= len(flat) or flat[i].shape != p.shape:
                    raise ConfigError("zero.offload_optimizer.device: nvme: the optimizer's "
                                      "state is not one array per parameter (plus counts)")
                entries.append((f"m{n_moment}", j))
                i += 1
            n_moment += 1
        else:
            entries.append(("scalar", n_scalar))
            n_scalar, i = n_scalar + 1, i + 1
    if i != len(flat):
        raise ConfigError("zero.offload_optimizer.device: nvme: the optimizer's state does "
                          "not split into per-parameter arrays and counts")
    return StateMap(treedef, entries)


def clip_scale(norm: float, clip_norm: float | None) -> float:
    """optax's ``clip_by_global_norm`` as one factor: 1 below the limit."""
    return 1.0 if clip_norm is None or norm < clip_norm else clip_norm / norm


def nvme_layout(plan: ShardPlan, abstract_master: Any, param_shardings: Any
                ) -> list[LeafShards]:
    """The :class:`LeafShards` of every param leaf."""
    state = plan.shardings(plan.state_specs)
    return [leaf_shards(j, a.shape, s, p, plan.stored_param_dtype(leaf))
            for j, (a, s, p, leaf) in enumerate(zip(
                jax.tree.leaves(abstract_master), jax.tree.leaves(state),
                jax.tree.leaves(param_shardings), plan.leaves, strict=True))]


class NvmeOptimizer:
    """The swap files of a run and the streamed update over them.

    Args:
      plan: the shard plan (``zero.offload_optimizer`` names the path and buffers).
      tx: an elementwise optax transform.
      abstract_master: the float32 master params, abstract, laid out as ``state_specs``.
      param_shardings: where the step takes its working params.
    """

    keep_params = True  # the working params live on the devices between steps

    def __init__(self, plan: ShardPlan, tx: optax.GradientTransformation,
                 abstract_master: Any, param_shardings: Any):
        check_elementwise(tx)
        zero = plan.zero
        self.section = zero.offload_optimizer
        self.plan, self.tx = plan, tx
        self.sub_group_size = zero.sub_group_size
        self.leaves = nvme_layout(plan, abstract_master, param_shardings)
        if self.keep_params:
            self.check_shards()
        self.state_map = _state_map(tx, abstract_master)
        self.n_parts = 1 + len({e for e, _ in self.state_map.entries if e != "scalar"})
        self.treedef = jax.tree.structure(abstract_master)
        self.opt: StreamingOptimizer | None = None
        self.step, self.param_norm = -1, float("nan")
        # why the swap files are mid-update (a step stopped after writing some master and
        # moments): no step or save may read them again
        self.torn: str | None = None

    def check_shards(self) -> None:
        """Raise unless every device shard is addressable by the stream's int32 offsets (a
        whole shard sliced on the device: the working params, init, restore).

        Raises:
          ConfigError: naming the leaf and its shard's elements.
        """
        for leaf, shards in zip(self.plan.leaves, self.leaves, strict=True):
            if max(shards.sizes, default=0) >= 2**31:  # sub-group offsets are int32 on device
                raise ConfigError(
                    f"zero.offload_optimizer.device: nvme: a device's shard of {leaf.path} has "
                    f"{max(shards.sizes):,} elements, over the 2**31 the stream addresses; "
                    "use more devices (or split the leaf)")

    @property
    def sizes(self) -> dict[str, int]:
        return {n: s for leaf in self.leaves for n, s in zip(leaf.names, leaf.sizes,
                                                               strict=True)}

    @property
    def nbytes(self) -> int:
        """Bytes of this process's swap files (master and per-parameter state)."""
        return 4 * self.n_parts * sum(self.sizes.values())

    def open(self) -> StreamingOptimizer:
        """Fresh swap files (what a previous run left there is never read).

        Raises:
          ConfigError: ``nvme_path`` is missing, not a writable directory, or has less free
            space than the files need (checked here, not when the step is built, so that
            ``zjax plan`` can plan for another machine's disk).
        """
        self.close()  # the store checks the path (after removing dead runs' swap files there)
        self.opt = StreamingOptimizer(self.tx, self.sizes, self.section.nvme_path,
                                      sub_group_size=self.sub_group_size,
                                      buffer_count=self.section.buffer_count, key=KEY)
        return self.opt

    def start(self, master: Any, step: int = 0) -> TrainState:
        """Swap files holding ``master`` (float32, laid out as ``state_specs``) and a fresh
        optimizer state; the working params on the devices."""
        opt = self.open()
        opt.write_initial({name: Slices(x) for a, leaf in zip(jax.tree.leaves(master),
                                                               self.leaves, strict=True)
                           for name, x in shard_data(a, leaf)})
        norm = jax.jit(global_norm, out_shardings=self.replicated)(master)
        self.param_norm = float(local_value(norm))
        return self.started(self.working(master) if self.keep_params else None, step)

    def working(self, master: Any) -> Any:
        """The working params of a float32 ``master``."""
        shardings = jax.tree.unflatten(self.treedef, [leaf.param for leaf in self.leaves])
        dtypes = [leaf.stored for leaf in self.leaves]
        cast = lambda m: jax.tree.unflatten(self.treedef, [
            x.astype(d) for x, d in zip(jax.tree.leaves(m), dtypes, strict=True)])
        return jax.jit(cast, out_shardings=shardings)(master)

    def started(self, params: Any, step: int) -> TrainState:
        self.step = step
        return TrainState(self.step_array(step), params, None, None)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.plan.mesh, P())

    def step_array(self, step: int) -> jax.Array:
        """``step`` as the in-memory state holds it: an int32 replicated over the mesh."""
        return jax.device_put(np.int32(step), self.replicated)

    def update(self, params: Any, grads: Any, *, grad_scale: float):
        """One streamed optimizer step: ``(new working params, param norm, StreamStats)``.

        ``params`` (the old working copy) is deleted once the gradients are ready.
        """
        grad_leaves = jax.tree.leaves(grads)
        jax.block_until_ready(grad_leaves)
        for x in jax.tree.leaves(params):
            x.delete()
        sources = {name: Slices(x) for g, leaf in zip(grad_leaves, self.leaves, strict=True)
                   for name, x in shard_data(g, leaf)}
        build = ParamBuilder(self.leaves)
        stats = self.opt.update(sources, build.put, grad_scale=grad_scale)
        sumsq = build.sumsq
        if jax.process_count() > 1:  # every process must agree on the norm and on `finite`
            both = multihost_utils.process_allgather(np.array([sumsq, stats.finite], np.float64))
            sumsq = float(both[:, 0].sum())
            stats = stats._replace(finite=bool(both[:, 1].all()))
        self.param_norm = float(np.sqrt(sumsq))
        return jax.tree.unflatten(self.treedef, build.result()), self.param_norm, stats

    def close(self) -> None:
        """Remove the swap files."""
        if self.opt is not None:
            self.opt.close()
            self.opt = None


def grads_program(grads_fn: Callable, plan: ShardPlan, param_shardings: Any,
                  batch_sharding) -> Callable:
    """The compiled part of an NVMe step: ``(params, batch) -> (mean grads as own shards,
    sums)``; ``sums`` holds ``loss_sum``, ``count``, the loss's own sums and ``grad_norm``."""
    own = plan.shardings(plan.state_specs)

    def fn(params, batch):
        grads, (loss_sum, count, extra) = grads_fn(params, None, batch)
        grads = jax.tree.map(lambda g: g / count, grads)
        grads = jax.lax.with_sharding_constraint(grads, own)
        return grads, {"loss_sum": loss_sum, "count": count, "extra": extra,
                       "grad_norm": global_norm(grads)}

    # the sums replicated over the whole mesh: each process reads them from its own devices
    return jax.jit(fn, in_shardings=(param_shardings, batch_sharding),
                   out_shardings=(own, NamedSharding(plan.mesh, P())),
                   compiler_options=dict(plan.backend.compiler_options))


class NvmeStep:
    """``step(state, batch) -> (state, metrics)`` with the optimizer on NVMe; ``lower(...)
    .compile()`` compiles its device program (the plan reads that program's memory and
    collectives). ``state`` is consumed: its working params are deleted.

    The metrics are the in-memory step's, plus ``nvme_read_gbs`` / ``nvme_write_gbs`` (swap
    traffic over the update's wall time) and ``nvme_update_s``. A non-finite gradient with
    ``skip_nonfinite`` skips the stream (nothing is written); a finite gradient whose update
    overflows is already on disk, and is reported (``finite`` False) but not undone.
    """

    def __init__(self, engine: NvmeOptimizer, program: Callable, *, clip_norm: float | None,
                 skip_nonfinite: bool, run: Callable | None = None):
        self.engine, self.program = engine, program
        self.clip_norm, self.skip_nonfinite = clip_norm, skip_nonfinite
        self._run = run if run is not None else program

    def lower(self, abstract_state: TrainState, batch: jax.ShapeDtypeStruct) -> _Lowered:
        return _Lowered(self, self.program.lower(abstract_state.params, batch))

    def __call__(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        step = int(local_value(state.step))
        if step != self.engine.step:
            raise RuntimeError(f"this state is at step {step}, but the NVMe swap files hold "
                               f"step {self.engine.step}: only the newest state can step")
        grads, sums = self._run(state.params, batch)
        loss_sum, count, norm = (float(local_value(sums[k]))
                                 for k in ("loss_sum", "count", "grad_norm"))
        finite = bool(np.isfinite(loss_sum) and np.isfinite(norm))
        nvme = {"nvme_read_gbs": 0.0, "nvme_write_gbs": 0.0, "nvme_update_s": 0.0}
        if finite or not self.skip_nonfinite:
            params, param_norm, stats = self.engine.update(
                state.params, grads, grad_scale=clip_scale(norm, self.clip_norm))
            finite = finite and stats.finite
            t = max(stats.seconds, 1e-9)
            nvme = {"nvme_read_gbs": stats.read_bytes / t / 1e9,
                    "nvme_write_gbs": stats.written_bytes / t / 1e9,
                    "nvme_update_s": stats.seconds}
        else:  # dropped: the files and the working params stay as they were
            params, param_norm = state.params, self.engine.param_norm
        self.engine.step = step + 1
        metrics = {"loss": loss_sum / count, "grad_norm": norm, "param_norm": param_norm,
                   "finite": finite, "count": count,
                   **metric_values({k: float(local_value(v)) for k, v in sums["extra"].items()},
                                   count),
                   **nvme}
        return (TrainState(self.engine.step_array(step + 1), params, None, None),
                {k: jnp.asarray(v) for k, v in metrics.items()})


class _Lowered:
    """The lowered device program of an :class:`NvmeStep`."""

    def __init__(self, step: NvmeStep, lowered):
        self._step, self._lowered = step, lowered

    def compile(self, compiler_options: dict | None = None) -> _Compiled:
        compiled = self._lowered.compile(compiler_options=compiler_options)
        s = self._step
        return _Compiled(NvmeStep(s.engine, s.program, clip_norm=s.clip_norm,
                                  skip_nonfinite=s.skip_nonfinite, run=compiled), compiled)

    def __getattr__(self, name: str):
        return getattr(self._lowered, name)


class _Compiled:
    """A compiled :class:`NvmeStep`: callable as the step; memory analysis and HLO text are
    its device program's."""

    def __init__(self, step: NvmeStep, compiled):
        self._step, self._compiled = step, compiled

    def __call__(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        return self._step(state, batch)

    def __getattr__(self, name: str):
        return getattr(self._compiled, name)


class NvmeParts(NamedTuple):
    """What :func:`zjax.step.make_step` needs of an NVMe step."""

    abstract: TrainState
    shardings: TrainState
    init: Callable[[jax.Array], TrainState]
    step: NvmeStep
    from_params: Callable[[Any], TrainState]
    canonical: dict
    engine: NvmeOptimizer


def nvme_abstract(init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation,
                  plan: ShardPlan) -> tuple[Any, Any, Any]:
    """``(own shardings, float32 master, optax state)``, abstract, laid out as the swap files
    and a checkpoint hold them (each device's own shard)."""
    own = plan.shardings(plan.state_specs)
    master = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=s),
                          jax.eval_shape(init_params, jax.random.key(0)), own)
    opt = jax.eval_shape(tx.init, master)
    opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       opt, plan.shardings(plan.opt_specs(tx, opt)))
    return own, master, opt


def nvme_parts(init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation,
               plan: ShardPlan, grads_fn: Callable, param_shardings: Any, batch_sharding, *,
               clip_norm: float | None, skip_nonfinite: bool) -> NvmeParts:
    """The state layout, init, step and checkpoint form of a step whose optimizer is on
    NVMe."""
    mesh = plan.mesh
    own, master, opt = nvme_abstract(init_params, tx, plan)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    engine = NvmeOptimizer(plan, tx, master, param_shardings)
    scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.tree.map(lambda a, s, leaf: jax.ShapeDtypeStruct(a.shape, leaf.stored,
                                                                  sharding=s),
                          master, param_shardings, plan.tree(engine.leaves))
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar), params, None,
                          None)
    shardings = TrainState(scalar, param_shardings, None, None)
    make_master = jax.jit(lambda rng: f32(init_params(rng)), out_shardings=own)
    return NvmeParts(
        abstract, shardings, lambda rng: engine.start(make_master(rng)),
        NvmeStep(engine, grads_program(grads_fn, plan, param_shardings, batch_sharding),
                 clip_norm=clip_norm, skip_nonfinite=skip_nonfinite),
        lambda p: engine.start(jax.jit(f32, out_shardings=own, donate_argnums=0)(p)),
        {"step": abstract.step, "params": master, "opt_state": opt}, engine)
