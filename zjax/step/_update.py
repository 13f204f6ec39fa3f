"""The optax update on sharded arrays, and the new state put back where it lives.

The update runs outside the ``shard_map`` so global reductions (``clip_by_global_norm``) see the
whole tree. Offload (:mod:`zjax.offload`): state placed in host memory is brought to the device
for the update and sent back; with ``update_on: host`` the update itself runs under
``compute_on("device_host")``.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from zjax.errors import ConfigError
from zjax.offload import global_norm, on_host, on_host_compute, to_device, to_host
from zjax.partition.gather import UINT
from zjax.partition.plan import ShardPlan
from zjax.step._state import StateLayout, TrainState, cast_tree

__all__ = ["Updated", "apply_update", "host_update_errors", "store"]


class Updated(NamedTuple):
    """The result of :func:`apply_update`."""

    params: Any
    opt_state: Any
    grad_norm: jax.Array
    param_norm: jax.Array
    finite: jax.Array


def _all_finite(tree) -> jax.Array:
    """Whether every float of ``tree`` is finite (no norm: squares overflow before values do)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.logical_and.reduce(jnp.stack(flags)) if flags else jnp.bool_(True)


def apply_update(tx: optax.GradientTransformation, grad_sums: Any, count: jax.Array,
                 loss_sum: jax.Array, opt_state: Any, params: Any, *, plan: ShardPlan,
                 skip_nonfinite: bool = False, clip_norm: float | None = None) -> Updated:
    """The optax update of float32 ``params`` by the mean gradient ``grad_sums / count``.

    Runs on the device, or on the host with ``zero.offload_optimizer.update_on: host``.
    ``finite``: loss, gradients, new params and optimizer state are all finite; with
    ``skip_nonfinite`` a non-finite update is dropped (the old params and state return).
    ``clip_norm``: the mean gradient is scaled down to this global norm before ``tx``.
    """
    on_host_update = plan.zero.offload_optimizer.update_on_host
    own_shard = plan.shardings(plan.state_specs)
    if on_host_update:
        own_shard = on_host(own_shard, plan.zero.offload_optimizer.memory_kind)
    move = to_host if on_host_update else to_device
    grads, count, loss_sum, opt_state, params = move(
        (grad_sums, count, loss_sum, opt_state, params))
    with on_host_compute(on_host_update):
        grads = jax.tree.map(lambda g: g / count, grads)
        grads = jax.lax.with_sharding_constraint(grads, own_shard)
        norm = global_norm(grads)  # not optax's: it cannot run on the host
        if clip_norm is not None:
            scale = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        param_norm = global_norm(new)
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(norm) & _all_finite((new, new_opt))
        if skip_nonfinite:
            keep = lambda n, o: jnp.where(finite, n, o)
            new, new_opt = jax.tree.map(keep, (new, new_opt), (params, opt_state))
    return Updated(new, new_opt, *to_device((norm, param_norm, finite)))


@contextlib.contextmanager
def host_update_errors(plan: ShardPlan):
    """Turn JAX's error for a host update that mixes memory spaces into a ConfigError.

    JAX raises a bare ValueError naming ``memory_space``; it has no type of its own to catch.
    """
    try:
        yield
    except ValueError as e:
        if not (plan.zero.offload_optimizer.update_on_host and "memory_space" in str(e)):
            raise
        raise ConfigError(
            "zero.offload_optimizer.update_on: host: the optimizer's update mixes host and "
            f"device values ({str(e).splitlines()[0]}); optax transforms that create "
            "device constants cannot run on the host: use update_on: device") from None


def _narrow_all_gather(master, dtypes, sharded, replicated):
    """Cast the new master on its shard, then all-gather the narrow working copy.

    The bits travel as unsigned integers: XLA would otherwise move the convert after the
    all-gather and move float32 (see :func:`zjax.partition.gather.all_gather`).
    """

    def one(x, dtype, s_in, s_out):
        narrow = x.astype(dtype)
        if not jnp.issubdtype(narrow.dtype, jnp.floating):
            return jax.lax.with_sharding_constraint(narrow, s_out)
        bits = lax.bitcast_convert_type(narrow, UINT[narrow.dtype.itemsize])
        bits = jax.lax.with_sharding_constraint(bits, s_in)
        bits = jax.lax.with_sharding_constraint(bits, s_out)
        return lax.bitcast_convert_type(bits, narrow.dtype)

    return jax.tree.map(one, master, dtypes, sharded, replicated)


def store(step: jax.Array, updated: Updated, layout: StateLayout, plan: ShardPlan
          ) -> TrainState:
    """The next state: offloaded leaves back to host memory, the rest on the device.

    Stages 0-2 with a float32 master: the new working copy is cast on the master's shard
    before it is all-gathered.
    """
    opt_state = jax.tree.map(lambda x, h: to_host(x) if h else to_device(x),
                             updated.opt_state, layout.opt_home)
    new = to_host(updated.params) if plan.master_on_host else to_device(updated.params)
    if plan.has_master:
        master = jax.lax.with_sharding_constraint(new, layout.shardings.master)
        params = _narrow_all_gather(to_device(master), layout.stored_dtypes,
                                    plan.shardings(plan.state_specs),
                                    plan.shardings(plan.param_specs))
    else:
        master, params = None, cast_tree(new, layout.stored_dtypes)
    return TrainState(step + 1, params, master, opt_state)
