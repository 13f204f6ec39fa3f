"""The preference losses on sequence log-probabilities, each as its paper (and Hugging Face
TRL's ``DPOTrainer``, ``CPOTrainer`` with ``loss_type="simpo"``, ``ORPOTrainer``) defines it.

A pair's inputs are the policy's summed log-probabilities of the chosen and the rejected
answer, their token counts and, for the methods with a reference, the reference's summed
log-probabilities. Each method returns a loss per pair and the metrics TRL logs, per pair
(the caller sums them over valid pairs and zjax divides by the pair count).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.preference.config import PreferenceConfig

__all__ = ["Pairs", "pair_losses"]


class Pairs(NamedTuple):
    """Per pair ``[P]`` float32: the policy's summed log-probabilities of the answers, their
    token counts and the reference's (None for a reference-free method)."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array
    ref_chosen: jax.Array | None = None
    ref_rejected: jax.Array | None = None


def _mean(logps: jax.Array, tokens: jax.Array) -> jax.Array:
    """A sequence's average log-probability per token (0 for a padding pair)."""
    return logps / jnp.maximum(tokens, 1.0)


def _smoothed(logits: jax.Array, eps: float) -> jax.Array:
    """``-log sigmoid(z) (1 - eps) - log sigmoid(-z) eps``: conservative DPO's loss."""
    loss = -jax.nn.log_sigmoid(logits) * (1.0 - eps)
    return loss - jax.nn.log_sigmoid(-logits) * eps if eps else loss


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-ln 2``. ``x`` is
    held at or below ``-1e-7`` (an average log-prob that float32 rounds to 0: a certain
    answer) and each branch sees only inputs it is finite on, so that neither ``where``
    branch's gradient is ``0 / 0`` (NaN, even where the branch is not taken)."""
    x = jnp.minimum(x, -1e-7)
    near = x > -0.6931471805599453
    return jnp.where(near, jnp.log(-jnp.expm1(jnp.where(near, x, -1.0))),
                     jnp.log1p(-jnp.exp(jnp.where(near, -1.0, x))))


def _dpo(p: Pairs, cfg: PreferenceConfig, *, averaged: bool):
    """DPO (``averaged``: IPO's length-normalised log-probabilities)."""
    norm = (lambda x, n: _mean(x, n)) if averaged else (lambda x, n: x)
    c, r = norm(p.chosen, p.chosen_tokens), norm(p.rejected, p.rejected_tokens)
    rc = norm(p.ref_chosen, p.chosen_tokens)
    rr = norm(p.ref_rejected, p.rejected_tokens)
    margin = (c - r) - (rc - rr)
    if averaged:  # IPO: the margin regressed onto 1 / (2 beta)
        losses = (margin - 1.0 / (2.0 * cfg.beta)) ** 2
    else:
        losses = _smoothed(cfg.beta * margin, cfg.label_smoothing)
    return losses, c, r, cfg.beta * (c - rc), cfg.beta * (r - rr), {}


def _simpo(p: Pairs, cfg: PreferenceConfig):
    c, r = _mean(p.chosen, p.chosen_tokens), _mean(p.rejected, p.rejected_tokens)
    losses = _smoothed(cfg.beta * (c - r) - cfg.gamma, cfg.label_smoothing)
    return losses, c, r, cfg.beta * c, cfg.beta * r, {}


def _orpo(p: Pairs, cfg: PreferenceConfig):
    c, r = _mean(p.chosen, p.chosen_tokens), _mean(p.rejected, p.rejected_tokens)
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    ratio = jax.nn.log_sigmoid(log_odds)
    extra = {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    return -cfg.beta * ratio, c, r, cfg.beta * c, cfg.beta * r, extra


def pair_losses(pairs: Pairs, cfg: PreferenceConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss [P], {metric: [P]})`` of ``cfg.method`` on ``pairs``.

    The loss adds ``cfg.nll_weight`` times the chosen answer's length-averaged negative
    log-likelihood (ORPO's SFT term; TRL's ``rpo_alpha`` / ``cpo_alpha``). The metrics are
    TRL's: ``rewards/chosen``, ``rewards/rejected`` (DPO, IPO: ``beta`` times the log-ratio
    to the reference; SimPO, ORPO: ``beta`` times the average log-probability),
    ``rewards/accuracies`` (chosen reward above the rejected), ``rewards/margins``,
    ``logps/chosen``, ``logps/rejected`` (the log-probabilities the loss compares), and
    ``nll_loss`` where it is trained; ORPO adds ``log_odds_ratio`` and ``log_odds_chosen``.
    """
    method = cfg.method
    if method in ("dpo", "ipo"):
        if pairs.ref_chosen is None:
            raise ValueError(f"preference.method {method} needs the reference's log-probs")
        losses, c, r, rc, rr, extra = _dpo(pairs, cfg, averaged=method == "ipo")
    elif method == "simpo":
        losses, c, r, rc, rr, extra = _simpo(pairs, cfg)
    elif method == "orpo":
        losses, c, r, rc, rr, extra = _orpo(pairs, cfg)
    else:
        raise ValueError(f"preference.method: {method!r} is not a preference loss")
    if cfg.nll_weight:
        nll = -_mean(pairs.chosen, pairs.chosen_tokens)
        losses = losses + cfg.nll_weight * nll
        extra = {**extra, "nll_loss": nll}
    rc, rr = lax.stop_gradient(rc), lax.stop_gradient(rr)
    metrics = {"rewards/chosen": rc, "rewards/rejected": rr,
               "rewards/accuracies": (rc > rr).astype(jnp.float32),
               "rewards/margins": rc - rr, "logps/chosen": c, "logps/rejected": r, **extra}
    return losses, {k: lax.stop_gradient(v) for k, v in metrics.items()}
