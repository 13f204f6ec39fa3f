"""What a language-model batch may carry: tokens, and for packed documents their segment ids,
per-token positions and a loss mask.

A batch is either an int array ``[B, T + 1]`` (one sequence per row), or a mapping with
``tokens`` ``[B, T + 1]`` and any of ``segment_ids`` (ints, one per document in the row, 0 for
padding), ``positions`` (each token's position in its document; derived from the segment ids
when absent) and ``loss_mask`` (1 where the token is to be predicted, 0 where not: a prompt),
each ``[B, T + 1]``, aligned with the tokens. In training with dropout on adapters the step
adds ``dropout_keys``: uint32 key data ``[B, 2]``, one per row (:func:`zjax.lora.row_keys`).

Under sequence parallelism (a ``context`` axis of ``C`` in the step's mesh) every device holds
its rows' whole token arrays, and :func:`split_batch` gives it its share of each sequence:
chunks ``i`` and ``2C - 1 - i`` of ``2C`` (:func:`zjax.nn.context.stripe_shard`, which balances
causal attention), with every token's global position, so rotary and learned position
embeddings, segment ids and the loss weights stay those of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zjax.errors import ArgumentError
from zjax.nn import model_axis_size
from zjax.nn.context import stripe_shard
from zjax.runtime.mesh import CONTEXT

__all__ = ["BATCH_KEYS", "DROPOUT_KEYS", "Packing", "positions_from_segments", "split_batch"]

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
DROPOUT_KEYS = "dropout_keys"


class Packing(NamedTuple):
    """What the blocks see of a batch besides its tokens: packed documents (attention stays
    within a segment, positions restart in each document), and the rows' dropout keys.

    Attributes:
      segment_ids: int ``[B, T]``; 0 marks padding. None: one document per row (a row split
        over a context axis, whose positions are not ``0..T-1``).
      positions: int ``[B, T]``; None: ``0..T-1`` (only with ``dropout`` and one document
        per row).
      dropout: uint32 key data ``[B, 2]`` for dropout on adapters' inputs, or None.
    """

    segment_ids: jax.Array | None
    positions: jax.Array | None
    dropout: jax.Array | None = None


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Each token's index within its run of equal segment ids (``[B, T]`` ints)."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def split_batch(batch) -> tuple[jax.Array, jax.Array, jax.Array | None, Packing | None]:
    """``(inputs [B, T], targets [B, T], weights [B, T] float32 or None, packing or None)``.

    A target counts (weight 1) when it continues its input's document (same segment, not
    padding) and its ``loss_mask`` is set; None weights mean every target counts. Inside a
    step with a ``context`` axis of ``C`` > 1, each is this device's ``T / C`` tokens of the
    striped layout, and ``packing`` always carries their global positions.
    """
    inputs, targets, weights, packing = _whole(batch)
    n = model_axis_size(CONTEXT)
    if n == 1:
        return inputs, targets, weights, packing
    if packing is None or packing.positions is None:
        pos = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        packing = Packing(None, pos, None if packing is None else packing.dropout)
    mine = lambda x: None if x is None else stripe_shard(x, axis_name=CONTEXT)
    return (mine(inputs), mine(targets), mine(weights),
            Packing(mine(packing.segment_ids), mine(packing.positions), packing.dropout))


def _whole(batch) -> tuple[jax.Array, jax.Array, jax.Array | None, Packing | None]:
    if not isinstance(batch, Mapping):
        return batch[:, :-1], batch[:, 1:], None, None
    inputs, targets, weights, packing = _documents(batch)
    keys = batch.get(DROPOUT_KEYS)
    if keys is None:
        return inputs, targets, weights, packing
    return inputs, targets, weights, Packing(*(packing or (None, None))[:2], keys)


def _documents(batch: Mapping) -> tuple[jax.Array, jax.Array, jax.Array | None,
                                        Packing | None]:
    unknown = sorted(set(batch) - {*BATCH_KEYS, DROPOUT_KEYS})
    if unknown or "tokens" not in batch:
        raise ArgumentError("batch", f"a batch mapping holds {', '.join(BATCH_KEYS)} "
                            f"('tokens' required), got {sorted(batch)}")
    tokens = batch["tokens"]
    for key in BATCH_KEYS[1:]:
        if key in batch and batch[key].shape != tokens.shape:
            raise ArgumentError("batch", f"{key} has shape {batch[key].shape}, the tokens "
                                f"{tokens.shape}")
    weights, packing = None, None
    if "segment_ids" in batch:
        seg = batch["segment_ids"].astype(jnp.int32)
        pos = batch.get("positions")
        pos = positions_from_segments(seg) if pos is None else pos.astype(jnp.int32)
        packing = Packing(seg[:, :-1], pos[:, :-1])
        weights = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)).astype(jnp.float32)
    elif "positions" in batch:  # without documents, where positions restart is unknown
        raise ArgumentError("batch", "positions need segment_ids (which documents they "
                            "number)")
    if "loss_mask" in batch:
        mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
        weights = mask if weights is None else weights * mask
    return tokens[:, :-1], tokens[:, 1:], weights, packing
