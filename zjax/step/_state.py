"""The train state: what it holds, how it is initialised, where each leaf lives.

Mixed precision: master params and optimizer state are float32. Stage 3 stores only the float32
master shards (the cast to ``gather_dtype`` happens at the gather). Stages 0-2 store a replicated
working copy in ``gather_dtype`` and, when that is narrower, a float32 master placed like the
optimizer state (sharded from stage 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zjax.offload import on_host
from zjax.partition import frozen_part, split_parts, trained_part
from zjax.partition.plan import ShardPlan

__all__ = ["StateLayout", "TrainState", "cast_tree", "make_init", "state_from", "state_layout"]


class TrainState(NamedTuple):
    """Everything a step updates.

    Attributes:
      step: number of optimizer steps taken.
      params: stored params (stage 3: float32 master shards; stages 0-2: working copy).
      master: float32 master params when stored apart from ``params``, else None.
      opt_state: the optax state.
      frozen: the leaves that are not trained (an adapter's base), in their own dtype, placed
        as stored params are; None when every leaf is trained. ``params``, ``master`` and
        ``opt_state`` then hold the trained leaves only.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    frozen: Any = None


class StateLayout(NamedTuple):
    """Where the state lives (cf. maxtext ``get_abstract_state``).

    Attributes:
      abstract: ``TrainState`` of ``ShapeDtypeStruct`` carrying ``shardings``.
      shardings: ``TrainState`` of ``NamedSharding``, host memory kinds where offloaded.
      opt_home: a bool per optimizer-state leaf: whether it lives in host memory.
      stored_dtypes: the dtype of each stored param leaf (``params`` of the state).
    """

    abstract: TrainState
    shardings: TrainState
    opt_home: Any
    stored_dtypes: Any


def cast_tree(tree: Any, dtypes: Any) -> Any:
    """Cast each leaf of ``tree`` to the matching dtype of ``dtypes``."""
    return jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)


def _stored_dtypes(plan: ShardPlan) -> Any:
    return plan.tree(plan.stored_param_dtype(leaf) for leaf in plan.leaves)


def state_from(tx: optax.GradientTransformation, plan: ShardPlan
               ) -> Callable[[Any], TrainState]:
    """``from_params(master) -> TrainState`` at step 0: the stored copy of the float32
    ``master`` params and a fresh optax state (of the trained leaves; the frozen ones kept
    apart in their own dtype)."""
    trained = trained_part(plan)
    stored = _stored_dtypes(trained)

    def from_params(master: Any) -> TrainState:
        frozen = None
        if trained is not plan:
            master, frozen = split_parts(plan, master)
            frozen = cast_tree(frozen, _stored_dtypes(frozen_part(plan)))
        master = jax.tree.map(lambda x: x.astype(jnp.float32), master)
        return TrainState(jnp.zeros((), jnp.int32), cast_tree(master, stored),
                          master if trained.has_master else None, tx.init(master), frozen)

    return from_params


def make_init(init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation,
              plan: ShardPlan) -> Callable[[jax.Array], TrainState]:
    """``init(rng) -> TrainState``: float32 master params, the stored copy, the optax state."""
    from_params = state_from(tx, plan)
    return lambda rng: from_params(init_params(rng))


def state_layout(plan: ShardPlan, tx: optax.GradientTransformation,
                 init: Callable[[jax.Array], TrainState]) -> StateLayout:
    """The abstract state of ``init`` and its shardings under ``plan``, nothing allocated."""
    abstract = jax.eval_shape(init, jax.random.key(0))
    full, plan = plan, trained_part(plan)
    specs = TrainState(P(), plan.param_specs, plan.state_specs if plan.has_master else None,
                       plan.opt_specs(tx, abstract.opt_state),
                       None if full is plan else frozen_part(full).param_specs)
    shardings = plan.shardings(specs)
    zero = plan.zero
    # optax's step counts (scalars) stay in device memory: their bytes are nil, and an s32
    # count updated on the host and aliased back to a host buffer fails TPU's HLO verifier
    # ("Shape and memory space of the result ... must be the same as ... aliased parameter")
    opt_home = jax.tree.map(lambda a: plan.opt_on_host and a.ndim > 0, abstract.opt_state)
    param_kind = zero.offload_param.memory_kind
    shardings = shardings._replace(
        params=on_host(shardings.params, param_kind) if plan.params_on_host
        else shardings.params,
        frozen=on_host(shardings.frozen, param_kind)
        if plan.params_on_host and shardings.frozen is not None else shardings.frozen,
        master=on_host(shardings.master, param_kind)
        if plan.has_master and plan.master_on_host else shardings.master,
        opt_state=jax.tree.map(
            lambda s, h: s.with_memory_kind(zero.offload_optimizer.memory_kind) if h else s,
            shardings.opt_state, opt_home),
    )
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return StateLayout(abstract, shardings, opt_home, _stored_dtypes(plan))
