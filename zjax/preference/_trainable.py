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

__all__ = ["REFERENCE", "frozen_copy", "preference_trainable", "with_copy"]

REFERENCE = "reference"  # the frozen copy's leaves: params["reference"][...]


def _with_copy(make_model: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    model = make_model(rngs)
    setattr(model, REFERENCE, nnx.clone(model))
    return model


def with_copy(make_model: Callable[[nnx.Rngs], nnx.Module]
              ) -> Callable[[nnx.Rngs], nnx.Module]:
    """``make_model`` whose model (drawn as without a reference) carries, as its
    ``reference`` attribute, a copy of itself."""
    return functools.partial(_with_copy, make_model)


def _cast(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def frozen_copy(trainable: Trainable, dtype, *,
                make_model: Callable[[nnx.Rngs], nnx.Module]) -> Trainable:
    """``trainable`` (built by :func:`with_copy` of ``make_model``) with its ``reference``
    leaves frozen, stored in ``dtype`` and made from the trained leaves at the start; its
    decoder is ``make_model``'s model on the policy's leaves alone (the copy never
    generates)."""
    policy = from_nnx(make_model, lambda model, batch: None).decoder

    def init(rng):
        params = dict(trainable.init(rng))
        params[REFERENCE] = _cast(params[REFERENCE], dtype)
        return params

    return dataclasses.replace(
        trainable, init=init,
        frozen=lambda path: path == REFERENCE or path.startswith(REFERENCE + "/"),
        frozen_from=lambda trained: {REFERENCE: _cast(trained, dtype)},
        decoder=lambda params: policy({k: v for k, v in params.items() if k != REFERENCE}))


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
    build = with_copy(make_model) if copy else make_model
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
        trainable = frozen_copy(trainable, jnp.dtype(reference_dtype), make_model=make_model)
    return dataclasses.replace(trainable, score=score, prepare=prepare)
