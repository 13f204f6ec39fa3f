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
from zjax.nn import layer_only
from zjax.partition.plan import ShardPlan
from zjax.step._nvme import nvme_abstract
from zjax.step._state import TrainState
from zjax.step._streamed import StreamedStep, StreamEngine, check_streamable

__all__ = ["streamed_parts"]


def streamed_parts(trainable: Trainable, tx: optax.GradientTransformation, plan: ShardPlan,
                   *, micro_batches: int, clip_norm: float | None,
                   skip_nonfinite: bool) -> dict[str, Any]:
    """The :class:`~zjax.step.ZeroStep` fields of the streamed step: no params in the state
    (they are read from the master in the swap files as the layers run)."""
    check_streamable(trainable, plan)
    own, master, opt = nvme_abstract(trainable.init, tx, plan)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    engine = StreamEngine(plan, tx, master, own)
    scalar = NamedSharding(plan.mesh, P())
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar), None, None,
                          None)
    init = _init_by_layers(trainable, plan, own, engine)
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


def _init_by_layers(trainable: Trainable, plan: ShardPlan, own: Any,
                    engine: StreamEngine) -> Callable[[jax.Array], TrainState]:
    """``init(rng)`` into the swap files without the whole model in memory: one program
    gives the leaves outside the Stacks (XLA drops the Stacks' initialisers), another, run
    once per layer, every Stack's layer ``i`` (:func:`zjax.nn.layer_only`: the values that
    layer has in the whole init)."""
    shardings = jax.tree.leaves(own)
    stacked = [j for j, leaf in enumerate(plan.leaves) if leaf.stacked]
    others = [j for j, leaf in enumerate(plan.leaves) if not leaf.stacked]
    depth = max((plan.leaves[j].shape[0] for j in stacked), default=0)
    f32 = lambda leaves, picked: [leaves[j].astype(jnp.float32) for j in picked]
    nonstack = jax.jit(lambda rng: f32(jax.tree.leaves(trainable.init(rng)), others),
                       out_shardings=[shardings[j] for j in others])

    def one_layer(rng, i):
        with layer_only(i):
            return f32(jax.tree.leaves(trainable.init(rng)), stacked)

    layer = jax.jit(one_layer, out_shardings=[shardings[j] for j in stacked])
    return lambda rng: engine.start_by_layers(functools.partial(nonstack, rng),
                                              lambda i: layer(rng, np.int32(i)), depth)
