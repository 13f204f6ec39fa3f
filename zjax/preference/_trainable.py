"""A model trained on a preference loss: the policy, and where its reference comes from (a
frozen copy of the starting weights beside it, the base with the adapters off, or
precomputed values in the batch)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zjax.lora import LoraConfig
from zjax.models import Trainable, from_nnx, with_adapters
from zjax.preference._objective import (
    preference_loss,
    reference_logps,
    with_reference,
    without_reference,
)
from zjax.preference.config import PreferenceConfig

__all__ = ["REFERENCE", "preference_trainable"]

REFERENCE = "reference"  # the frozen copy's leaves: params["reference"][...]


def _with_copy(make_model: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """The model (drawn as without a reference) and, as its ``reference`` attribute, a copy
    of it."""
    model = make_model(rngs)
    setattr(model, REFERENCE, nnx.clone(model))
    return model


def _cast(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _frozen_copy(trainable: Trainable, dtype) -> Trainable:
    """``trainable`` with its ``reference`` leaves frozen, stored in ``dtype`` and made from
    the trained leaves at the start."""

    def init(rng):
        params = dict(trainable.init(rng))
        params[REFERENCE] = _cast(params[REFERENCE], dtype)
        return params

    return dataclasses.replace(
        trainable, init=init,
        frozen=lambda path: path == REFERENCE or path.startswith(REFERENCE + "/"),
        frozen_from=lambda trained: {REFERENCE: _cast(trained, dtype)})


def _score(model, batch):
    """The reference's log-probs of each row, by the model at the start (precomputing)."""
    return reference_logps(model, without_reference(batch)[0], copy=False)


def preference_trainable(make_model: Callable[[nnx.Rngs], nnx.Module],
                         config: PreferenceConfig, *, lora: LoraConfig | None = None,
                         linear_weights: tuple[str, ...] = (),
                         reference_dtype: str = "bfloat16") -> Trainable:
    """The model ``make_model`` builds, trained on ``config``'s preference loss.

    Args:
      make_model: ``make_model(rngs)``: the policy (with ``lora``'s adapters if enabled).
      config: the ``preference`` section (a method set).
      lora: the ``lora`` section: with adapters, the reference is the base with the
        adapters off (no copy), and the base is frozen (:func:`zjax.models.with_adapters`).
      linear_weights: the model's linear weights (a quantized base stores them so).
      reference_dtype: the frozen copy's dtype (``zero.gather_dtype``: the policy's
        working weights', so step 0's policy and reference are the same function).

    Returns:
      A :class:`~zjax.models.Trainable` whose loss is the preference loss; with
      ``reference: model`` and no adapters its params hold the copy under ``reference``
      (frozen, ``frozen_from`` the trained leaves); ``prepare`` adds the reference's
      log-probs to each batch (``reference: model``); ``score`` gives them per row where they
      are precomputed.
    """
    adapters = lora is not None and lora.enabled
    copy = config.source == "model" and not adapters
    build = functools.partial(_with_copy, make_model) if copy else make_model
    # precomputed log-probs come in the batch: none is ever computed in the loss
    reference = (functools.partial(reference_logps, copy=copy) if config.source == "model"
                 else None)
    loss = functools.partial(preference_loss, config=config, reference=reference)
    trainable = from_nnx(build, loss)
    score = None if copy else from_nnx(make_model, _score).loss
    # the reference's log-probs are computed by the step before the loss and outside its
    # differentiation (so never recomputed in the backward), then read from the batch
    prepare = None if config.source != "model" else from_nnx(
        build, functools.partial(with_reference, copy=copy)).loss
    if adapters:
        trainable = with_adapters(trainable, lora, names=linear_weights)
    if copy:
        trainable = _frozen_copy(trainable, jnp.dtype(reference_dtype))
    return dataclasses.replace(trainable, score=score, prepare=prepare)
