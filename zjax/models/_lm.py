"""The language-modelling loss of the reference models, through the chunked cross-entropy."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from zjax.models._batch import split_batch
from zjax.models._layers import check_length
from zjax.nn import model_axis_size
from zjax.nn.loss import chunked_cross_entropy
from zjax.nn.moe import RouterStats, batch_sum
from zjax.runtime.mesh import CONTEXT

__all__ = ["lm_loss", "router_losses", "sequence_logps", "token_losses"]


def lm_loss(model, batch) -> tuple:
    """Next-token cross-entropy of ``model`` (a GPT or Llama) on ``batch``.

    ``batch``: tokens ``[B, T + 1]``, or a mapping with packed documents
    (:mod:`zjax.models._batch`): attention stays within each document, positions restart in
    each, and only targets that continue their document (and pass the ``loss_mask``) count.
    The loss never holds ``[tokens, vocab]`` float32 logits: ``model.loss_chunk`` tokens at a
    time (:func:`zjax.nn.loss.chunked_cross_entropy`). A mixture of experts adds its router
    losses (:func:`router_losses`).

    Returns:
      ``(sum of token losses, token count)``: zjax divides by the global count, so a sharded
      run equals a single-device one; a mixture adds ``{metric: sum}`` (its router losses).
    """
    if getattr(model.cfg, "mtp_layers", 0):
        return _with_mtp(model, batch)
    losses, weights, stats = token_losses(model, batch)
    if weights is None:
        loss_sum, count = jnp.sum(losses), jnp.asarray(losses.size, jnp.float32)
    else:
        loss_sum, count = jnp.sum(losses * weights), jnp.sum(weights)
    if stats is None:
        return loss_sum, count
    return router_losses(stats, loss_sum, count, model.cfg)


def _ce(model, hidden, targets, temperature: float = 1.0):
    """Each target's ``-log p`` through the head, ``model.loss_chunk`` tokens at a time; Gemma
    2's final soft-cap where set (a GPT has none)."""
    return chunked_cross_entropy(hidden, model.head_weight(), targets,
                                 chunk=model.cfg.loss_chunk,
                                 softcap=getattr(model.cfg, "final_softcap", None),
                                 temperature=temperature)


def _with_mtp(model, batch) -> tuple:
    """:func:`lm_loss` plus DeepSeek-V3's multi-token prediction loss: the mean cross-entropy
    of the token after next (where both following targets count), times
    ``model.mtp_loss_coef``, reported as ``mtp_loss``."""
    if model_axis_size(CONTEXT) > 1:
        raise ValueError("model.mtp_layers: multi-token prediction under a context axis is "
                         "not built (its shifted sequence crosses the devices' stripes)")
    tokens = batch["tokens"] if isinstance(batch, Mapping) else batch
    check_length(tokens[:, 1:], model.cfg.max_seq_len)
    inputs, targets, weights, packing = split_batch(batch)
    hidden, stats = model.hidden_and_stats(inputs, packing)
    w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    loss_sum, count = jnp.sum(_ce(model, model.ln_f(hidden), targets) * w), jnp.sum(w)
    shifted = None if packing is None else jax.tree.map(lambda a: a[:, :-1], packing)
    mtp = _ce(model, model.mtp_features(hidden[:, :-1], targets[:, :-1], shifted),
              targets[:, 1:])
    mw = w[:, :-1] * w[:, 1:]
    totals = jnp.stack([count, jnp.sum(mw)])
    totals, mtp = lax.optimization_barrier((totals, mtp))  # after the layers: router_losses
    totals = batch_sum(lax.stop_gradient(totals))
    mtp_loss = jnp.sum(mtp * mw) * (totals[0] / jnp.maximum(totals[1], 1.0))
    loss_sum = loss_sum + model.cfg.mtp_loss_coef * mtp_loss
    metrics = {"mtp_loss": lax.stop_gradient(mtp_loss)}
    if stats is None:
        return loss_sum, count, metrics
    loss_sum, count, router = router_losses(stats, loss_sum, count, model.cfg)
    return loss_sum, count, {**router, **metrics}


def token_losses(model, batch, *, temperature: float = 1.0
                 ) -> tuple[jax.Array, jax.Array | None, RouterStats | None]:
    """``(losses [B, T] float32, weights [B, T] or None, router statistics or None)``: each
    target's ``-log p`` under ``model`` and whether it counts (:func:`lm_loss`'s parts; this
    device's share of each sequence under a ``context`` axis); ``temperature`` divides the
    logits (an RL policy's log-probs at its sampling temperature)."""
    tokens = batch["tokens"] if isinstance(batch, Mapping) else batch
    check_length(tokens[:, 1:], model.cfg.max_seq_len)  # the whole sequence, not a shard's
    inputs, targets, weights, packing = split_batch(batch)
    features = getattr(model, "features_and_stats", None)
    hidden, stats = (model.features(inputs, packing), None) if features is None \
        else features(inputs, packing)
    return _ce(model, hidden, targets, temperature), weights, stats


def sequence_logps(model, batch) -> tuple[jax.Array, jax.Array, RouterStats | None]:
    """``(log-probs [B], token counts [B], router statistics or None)``: each row's summed
    log-probability of its counted targets (an answer under its loss mask) and how many
    there are, float32; whole sequences' sums also under a ``context`` axis (summed over
    it)."""
    losses, weights, stats = token_losses(model, batch)
    if weights is None:
        weights = jnp.ones_like(losses)
    logps, counts = -jnp.sum(losses * weights, axis=1), jnp.sum(weights, axis=1)
    if model_axis_size(CONTEXT) > 1:  # each device holds a stripe of every sequence
        logps, counts = lax.psum((logps, counts), CONTEXT)
    return logps, counts, stats


def router_losses(stats: RouterStats, loss_sum: jax.Array, count: jax.Array, cfg) -> tuple:
    """``(loss_sum, count, metrics)`` with a mixture's router losses added.

    The load-balance and z losses are means over the batch, averaged over the layers
    (``stats`` holds this device's shares of their sums over the ``n_layers``); scaled by the
    batch's loss-token count, so that zjax's division by it leaves ``coefficient x loss``.
    ``moe_aux_loss`` and ``moe_z_loss`` are reported the same way; ``moe_dropped_tokens``
    counts the step's dropped token-expert assignments over every layer;
    ``moe_max_violation`` is DeepSeek's MaxVio (the most loaded expert's load over the mean,
    minus 1), averaged over the layers.
    """
    # after the layers (XLA:CPU would run this psum beside their loop's router psums, which
    # share its rendezvous: zjax.planning.unordered_collectives)
    # (both outputs used: XLA drops a barrier's unused ones, and the dependency with them)
    count_after, stats = lax.optimization_barrier((count, stats))
    total = batch_sum(lax.stop_gradient(count_after))
    layers = cfg.n_layers - getattr(cfg, "first_k_dense", 0)  # the mixture's layers
    aux = stats.balance * (total / layers)
    z = stats.z * (total / layers)
    seq = stats.seq_balance * (total / layers)
    moe = cfg.moe
    loss_sum = (loss_sum + moe.aux_loss_coef * aux + moe.z_loss_coef * z
                + moe.seq_aux_loss_coef * seq)
    # the same on every device: weighted by its tokens, the division by the batch's count
    # leaves the mean over the layers
    violation = stats.max_violation * (lax.stop_gradient(count) / layers)
    return loss_sum, count, {"moe_aux_loss": aux, "moe_z_loss": z,
                             "moe_dropped_tokens": stats.dropped,
                             "moe_max_violation": violation, "moe_seq_aux_loss": seq}
