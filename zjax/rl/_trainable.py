"""A model trained by GRPO: the policy, the reference its KL is measured against (a frozen
copy of the starting weights, or the base with the adapters off), what is scored once per
rollout batch, and the model it generates with."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from zjax.lora import LoraConfig
from zjax.models import Trainable, from_nnx, with_adapters
from zjax.preference import frozen_copy, with_copy
from zjax.rl._objective import grpo_loss, grpo_score, scored_keys
from zjax.rl.config import RLConfig

__all__ = ["rl_trainable"]


def rl_trainable(make_model: Callable[[nnx.Rngs], nnx.Module], config: RLConfig, *,
                 lora: LoraConfig | None = None, linear_weights: tuple[str, ...] = (),
                 reference_dtype: str = "bfloat16") -> Trainable:
    """The model ``make_model`` builds, trained on ``config``'s GRPO loss.

    Args:
      make_model: ``make_model(rngs)``: the policy (with ``lora``'s adapters if enabled).
      config: the ``rl`` section (a method set).
      lora: the ``lora`` section: with adapters the reference is the base with the adapters
        off (no copy) and the base is frozen.
      linear_weights: the model's linear weights (a quantized base stores them so).
      reference_dtype: the frozen copy's dtype (``zero.gather_dtype``), where ``kl_beta`` >
        0 and there are no adapters.

    Returns:
      A :class:`~zjax.models.Trainable` whose loss is GRPO's; ``score`` gives the log-probs
      a rollout batch is scored for (:func:`zjax.rl.scored_keys`; None when there are none)
      and ``decoder`` the policy to generate with.
    """
    adapters = lora is not None and lora.enabled
    copy = config.kl_beta > 0 and not adapters
    build = with_copy(make_model) if copy else make_model
    trainable = from_nnx(build, functools.partial(grpo_loss, config=config))
    score = None
    if scored_keys(config):
        score = from_nnx(build, functools.partial(grpo_score, config=config, copy=copy)).loss
    if adapters:
        trainable = with_adapters(trainable, lora, names=linear_weights)
    if copy:
        trainable = frozen_copy(trainable, jnp.dtype(reference_dtype), make_model=make_model)
    return dataclasses.replace(trainable, score=score)
