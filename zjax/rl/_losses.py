"""GRPO's parts as Hugging Face TRL's ``GRPOTrainer`` computes them (DeepSeekMath, Shao et
al. 2024; Dr. GRPO, Liu et al. 2025; DAPO, Yu et al. 2025): group-relative advantages from
rewards, and the clipped per-token policy loss with the k3 KL estimator, averaged three ways.

The loss is returned as zjax's ``(sum, count)`` pair so that micro-batches and devices add
up to TRL's single-batch value: ``grpo`` sums each completion's token mean over completions
(count: completions), ``dr_grpo`` sums the tokens' losses over ``max_new_tokens`` (count:
completions), ``dapo`` sums the tokens' losses (count: tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TokenLoss", "group_advantages", "policy_loss"]


def group_advantages(rewards: np.ndarray, group_size: int, *, scale: bool = True
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, each group's reward standard deviation)`` of ``rewards`` ``[P x G]``
    (each prompt's ``G`` completions in a row): a reward less its group's mean, divided by
    the group's standard deviation (unbiased, as torch's ``std``) plus 1e-4 where ``scale``.
    """
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    std = r.std(axis=1, ddof=1)
    adv = r - r.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (std[:, None] + 1e-4)
    return adv.reshape(-1).astype(np.float32), std.astype(np.float32)


class TokenLoss(NamedTuple):
    """The loss's sum and count (zjax divides), and the metrics' sums over tokens."""

    loss_sum: jax.Array
    count: jax.Array
    kl_sum: jax.Array
    clipped_sum: jax.Array
    tokens: jax.Array


def policy_loss(logps: jax.Array, old_logps: jax.Array, advantages: jax.Array,
                mask: jax.Array, *, ref_logps: jax.Array | None = None, kl_beta: float = 0.0,
                epsilon: float = 0.2, loss: str = "dapo", max_new_tokens: int = 1
                ) -> TokenLoss:
    """GRPO's loss on completions ``[B, T]``: per token ``-min(ratio A, clip(ratio) A) +
    kl_beta KL``, with ``ratio = exp(logp - old_logp)`` and TRL's k3 estimator ``KL =
    exp(ref - logp) - (ref - logp) - 1``, under ``mask`` (the completions' tokens).

    Args:
      logps: the policy's log-prob of each completion token (differentiated).
      old_logps: the rollout policy's (the same values on-policy: the ratio is 1, its
        gradient the policy gradient).
      advantages: ``[B]``, one per completion.
      mask: ``[B, T]``, 1 on completion tokens.
      ref_logps: the reference's, where ``kl_beta`` > 0.
      kl_beta: the KL penalty's weight.
      epsilon: the ratio's clipping range.
      loss: ``grpo``, ``dr_grpo`` or ``dapo`` (the module docstring's averaging).
      max_new_tokens: ``dr_grpo``'s constant length.
    """
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(logps - old_logps)
    a = advantages[:, None]
    unclipped, clipped = ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a
    per_token = -jnp.minimum(unclipped, clipped)
    kl = jnp.zeros_like(per_token)
    if kl_beta:
        delta = ref_logps - logps
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * kl
    lengths = jnp.sum(mask, axis=1)
    masked = jnp.sum(per_token * mask, axis=1)
    n = jnp.asarray(mask.shape[0], jnp.float32)
    if loss == "grpo":
        loss_sum, count = jnp.sum(masked / jnp.maximum(lengths, 1.0)), n
    elif loss == "dr_grpo":
        loss_sum, count = jnp.sum(masked) / max_new_tokens, n
    elif loss == "dapo":
        loss_sum, count = jnp.sum(masked), jnp.sum(lengths)
    else:
        raise ValueError(f"rl.loss: {loss!r} is not one of grpo, dr_grpo, dapo")
    is_clipped = (unclipped > clipped).astype(jnp.float32)  # the clipped term was the min
    stop = jax.lax.stop_gradient
    return TokenLoss(loss_sum, count, stop(jnp.sum(kl * mask)), stop(jnp.sum(is_clipped * mask)),
                     stop(jnp.sum(lengths)))
