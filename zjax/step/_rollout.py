"""Generation from the training state's shards, as DeepSpeed-Chat's Hybrid Engine does.

Gathering every layer for every decoded token (the training step's ZeRO-3 layout) would move
the whole model once per token. The rollout program instead casts the stored params to
``zero.gather_dtype`` and all-gathers them once, into a replicated inference layout, decodes
every prompt of the batch (rows split over the batch's axes: each device decodes its own)
with the key/value cache, and drops the gathered copy when the program ends. Its memory is
the state's plus one gathered model plus the cache: what ``zjax plan`` shows as the rollout
phase.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.generate import decode_tokens
from zjax.models.trainable import Trainable
from zjax.offload import to_device
from zjax.partition import merge_parts
from zjax.partition.plan import ShardPlan
from zjax.runtime.mesh import batch_axes

__all__ = ["make_rollout"]


def _inference_params(plan: ShardPlan, mesh: Mesh, parts: tuple, shardings: tuple):
    """The whole model's params, in the gather dtype (integer codes of a quantized base as
    they are), replicated on every device: one all-gather of each stored shard.

    ``parts``: the state's ``(params, frozen)``, placed as ``shardings`` say. Each shard is
    cast where it lies before the gather (pinned by a constraint to its own layout): else
    the partitioner gathers the float32 master and casts after, twice the bytes."""
    if plan.params_on_host:
        parts = to_device(parts)
    dtype = jnp.dtype(plan.zero.gather)

    def cast(x, sharding):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.lax.with_sharding_constraint(x.astype(dtype),
                                                NamedSharding(mesh, sharding.spec))

    params, frozen = (None if part is None else jax.tree.map(cast, part, where)
                      for part, where in zip(parts, shardings, strict=True))
    whole = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole),
                        merge_parts(plan, params, frozen))


def make_rollout(trainable: Trainable, plan: ShardPlan, mesh: Mesh, in_shardings: tuple
                 ) -> Callable | None:
    """``rollout(params, frozen, prompts, pads, key, stop, new, temperature, top_p) ->
    [rows, new]`` tokens, jitted (``new``, ``temperature`` and ``top_p`` static, given by
    position), or None for a model without a ``decoder``.

    ``params`` and ``frozen`` are the state's (``in_shardings``' first two), ``prompts``
    ``[rows, L]`` left-padded by ``pads`` ``[rows]`` and split over the batch's axes like a
    batch, ``stop`` the ids that end a row (:func:`zjax.generate.decode_tokens`: -1 after a
    row's stop, the draws keyed by ``key``).
    """
    if trainable.decoder is None:
        return None
    rows = NamedSharding(mesh, P(batch_axes(mesh)))

    def rollout(params, frozen, prompts, pads, key, stop, new: int, temperature: float,
                top_p: float):
        model = trainable.decoder(_inference_params(plan, mesh, (params, frozen),
                                                    in_shardings[:2]))
        return decode_tokens(model, prompts, pads, key, stop, new=new, temperature=temperature,
                             top_p=top_p, cache_dtype=jnp.dtype(plan.zero.gather))

    replicated = NamedSharding(mesh, P())
    return jax.jit(rollout, in_shardings=(*in_shardings[:2], rows, rows, replicated,
                                          replicated),
                   out_shardings=rows, static_argnums=(6, 7, 8),
                   compiler_options=dict(plan.backend.compiler_options))
