"""What :func:`zjax.step.make_step` needs of a streamed step (parameters on NVMe)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.models.trainable import Trainable
from zjax.partition.plan import ShardPlan
from zjax.step._state import TrainState
from zjax.step._streamed import StreamedStep, StreamEngine, check_streamable

__all__ = ["streamed_parts"]


def streamed_parts(trainable: Trainable, tx: optax.GradientTransformation, plan: ShardPlan,
                   *, micro_batches: int, clip_norm: float | None,
                   skip_nonfinite: bool) -> dict[str, Any]:
    """The :class:`~zjax.step.ZeroStep` fields of the streamed step: no params in the state
    (they are read from the master in the swap files as the layers run)."""
    check_streamable(trainable, plan)
    own = plan.shardings(plan.state_specs)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    master = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=s),
                          jax.eval_shape(trainable.init, jax.random.key(0)), own)
    engine = StreamEngine(plan, tx, master, own)
    scalar = NamedSharding(plan.mesh, P())
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar), None, None,
                          None)
    opt = jax.eval_shape(tx.init, master)
    opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       opt, plan.shardings(plan.opt_specs(tx, opt)))
    init = _init_by_groups(trainable, plan, own, engine)
    step = StreamedStep(engine, trainable, plan, micro_batches=micro_batches,
                        clip_norm=clip_norm, skip_nonfinite=skip_nonfinite)
    from_params: Callable = lambda p: engine.start(
        jax.jit(f32, out_shardings=own, donate_argnums=0)(p))
    return dict(state_shardings=TrainState(scalar, None, None, None), abstract_state=abstract,
                batch_sharding=step.batch_sharding,
                init=init, step=step,
                evaluate=step.evaluate, evaluate_metrics=step.evaluate_metrics,
                from_params=from_params, params_shardings=own,
                canonical={"step": abstract.step, "params": master, "opt_state": opt},
                nvme=engine)


def _init_by_groups(trainable: Trainable, plan: ShardPlan, own: Any,
                    engine: StreamEngine) -> Callable[[jax.Array], TrainState]:
    """``init(rng)`` into the swap files a group of leaves at a time: the leaves in order,
    a group up to ``buffer_count x buffer_size`` elements (a larger leaf alone), each group
    its own program of ``trainable.init`` (XLA drops the other leaves' initialisers), so the
    values are the whole init's and the whole model is never in memory."""
    section = plan.zero.offload_param
    budget = section.buffer_count * section.buffer_size
    groups: list[list[int]] = [[]]
    size = 0
    for j, leaf in enumerate(plan.leaves):
        if groups[-1] and size + leaf.size > budget:
            groups.append([])
            size = 0
        groups[-1].append(j)
        size += leaf.size
    shardings = jax.tree.leaves(own)

    def values(rng: jax.Array, group: list[int]) -> list[jax.Array]:
        pick = lambda key: [jax.tree.leaves(trainable.init(key))[j].astype(jnp.float32)
                            for j in group]
        return jax.jit(pick, out_shardings=[shardings[j] for j in group])(rng)

    return lambda rng: engine.start_by_leaves(groups, functools.partial(values, rng))
