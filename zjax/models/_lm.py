"""The language-modelling loss of the reference models, through the chunked cross-entropy."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from zjax.models._batch import split_batch
from zjax.models._layers import check_length
from zjax.nn.loss import chunked_cross_entropy

__all__ = ["lm_loss"]


def lm_loss(model, batch) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy of ``model`` (a GPT or Llama) on ``batch``.

    ``batch``: tokens ``[B, T + 1]``, or a mapping with packed documents
    (:mod:`zjax.models._batch`): attention stays within each document, positions restart in
    each, and only targets that continue their document (and pass the ``loss_mask``) count.
    The loss never holds ``[tokens, vocab]`` float32 logits: ``model.loss_chunk`` tokens at a
    time (:func:`zjax.nn.loss.chunked_cross_entropy`).

    Returns:
      ``(sum of token losses, token count)``: zjax divides by the global count, so a sharded
      run equals a single-device one.
    """
    tokens = batch["tokens"] if isinstance(batch, Mapping) else batch
    check_length(tokens[:, 1:], model.cfg.max_seq_len)  # the whole sequence, not a shard's
    inputs, targets, weights, packing = split_batch(batch)
    hidden = model.features(inputs, packing)
    # Gemma 2's final soft-cap (a GPT has none)
    losses = chunked_cross_entropy(hidden, model.head_weight(), targets,
                                   chunk=model.cfg.loss_chunk,
                                   softcap=getattr(model.cfg, "final_softcap", None))
    if weights is None:
        return jnp.sum(losses), jnp.asarray(targets.size, jnp.float32)
    return jnp.sum(losses * weights), jnp.sum(weights)
