"""GRPO's loss over a model's batch of completions, and the log-probs scored once per
rollout batch (the rollout policy's, for a ratio off-policy; the reference's, for the KL).

A batch row is a prompt followed by one of its completions, padded on the right:
``tokens`` ``[B, S + 1]`` and ``loss_mask`` (1 on the completion's tokens, the stop token
included, as TRL's completion mask), plus ``advantages`` ``[B]`` and, where scored,
``old_logps`` / ``ref_logps`` ``[B, S]`` aligned with the targets.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jax import lax

from zjax.errors import ConfigError
from zjax.models import adapters_off, router_losses, token_losses
from zjax.nn import model_axis_size
from zjax.rl._losses import policy_loss
from zjax.rl.config import RLConfig
from zjax.runtime.mesh import CONTEXT

__all__ = ["ADVANTAGES", "OLD_LOGPS", "REF_LOGPS", "grpo_loss", "grpo_score", "scored_keys"]

ADVANTAGES, OLD_LOGPS, REF_LOGPS = "advantages", "old_logps", "ref_logps"


def scored_keys(config: RLConfig) -> tuple[str, ...]:
    """What a rollout batch is scored for before training on it: the rollout policy's
    log-probs when it trains more than one step on it (on-policy, the ratio's denominator
    is the policy's own log-prob, detached), the reference's when ``kl_beta`` > 0."""
    return ((OLD_LOGPS,) if config.steps_per_generation > 1 else ()) + \
        ((REF_LOGPS,) if config.kl_beta > 0 else ())


def _split(batch: Mapping) -> tuple[dict, dict]:
    batch = dict(batch)
    extra = {k: batch.pop(k) for k in (ADVANTAGES, OLD_LOGPS, REF_LOGPS) if k in batch}
    return batch, extra


def _logps(model, batch: Mapping, temperature: float) -> tuple:
    if model_axis_size(CONTEXT) > 1:
        raise ConfigError("mesh.context: GRPO's completions are short: train them without a "
                          "context axis (mesh.context=1)")
    losses, weights, stats = token_losses(model, batch, temperature=temperature)
    return -losses, weights, stats


def grpo_score(model, batch: Mapping, *, config: RLConfig, copy: bool) -> dict:
    """``{old_logps?, ref_logps?: [B, S]}`` (:func:`scored_keys`): the policy's and the
    reference's (the frozen copy ``model.reference`` with ``copy``, else ``model`` with its
    adapters off) log-prob of each target at the sampling temperature; no gradient."""
    batch, _ = _split(batch)
    out = {}
    for key in scored_keys(config):
        if key == OLD_LOGPS:
            out[key] = _logps(model, batch, config.temperature)[0]
        elif copy:
            out[key] = _logps(model.reference, batch, config.temperature)[0]
        else:
            with adapters_off(model):
                out[key] = _logps(model, batch, config.temperature)[0]
    return jax.tree.map(lax.stop_gradient, out)


def grpo_loss(model, batch: Mapping, *, config: RLConfig) -> tuple:
    """``(loss sum, count, {metric: sum})`` of GRPO (:func:`zjax.rl.policy_loss`) on
    ``batch``; metrics ``kl`` and ``clip_ratio`` are means over completion tokens
    (``completion_tokens``), whatever ``rl.loss`` averages over."""
    batch, extra = _split(batch)
    if ADVANTAGES not in extra:
        raise ConfigError("rl.method: grpo trains on rollout batches (advantages, completions); "
                          "this batch has none: use the GRPO loop's data (data.format: prompt)")
    logps, mask, stats = _logps(model, batch, config.temperature)
    old = extra.get(OLD_LOGPS)
    # on-policy the rollout policy is the policy itself: ratio 1, its gradient the policy's
    old = lax.stop_gradient(logps) if old is None else old
    out = policy_loss(logps, old, extra[ADVANTAGES], mask, ref_logps=extra.get(REF_LOGPS),
                      kl_beta=config.kl_beta, epsilon=config.clip_epsilon, loss=config.loss,
                      max_new_tokens=config.max_new_tokens)
    sums = {"kl@completion_tokens": out.kl_sum, "clip_ratio@completion_tokens": out.clipped_sum,
            "completion_tokens": out.tokens}
    loss_sum, count = out.loss_sum, out.count
    if stats is not None:  # a mixture's router losses
        loss_sum, count, router = router_losses(stats, loss_sum, count, model.cfg)
        sums |= router
    return loss_sum, count, sums
