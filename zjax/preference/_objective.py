"""A preference loss over a model's batch of pairs: rows ``2i`` (chosen) and ``2i + 1``
(rejected) of every local batch, their answers' log-probabilities from one forward pass of
the policy and, for DPO and IPO, the reference's (a frozen copy, the base with adapters off,
or precomputed values carried in the batch as ``ref_logps``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from zjax.errors import ConfigError
from zjax.models import adapters_off, router_losses, sequence_logps
from zjax.nn import model_axis_size
from zjax.preference._losses import Pairs, pair_losses
from zjax.preference.config import PreferenceConfig
from zjax.runtime.mesh import CONTEXT

__all__ = ["REFERENCE_KEY", "preference_loss", "reference_logps", "with_reference",
           "without_reference"]

REFERENCE_KEY = "ref_logps"  # a batch's precomputed reference log-probs, float32 [rows]


def without_reference(batch: Mapping) -> tuple[dict, jax.Array | None]:
    """``(the batch the model reads, its precomputed reference log-probs or None)``."""
    batch = dict(batch)
    return batch, batch.pop(REFERENCE_KEY, None)


def reference_logps(model, batch: Mapping, *, copy: bool) -> jax.Array:
    """The reference's summed log-probability of each row's answer, no gradient: the frozen
    copy ``model.reference`` (``copy``), else ``model`` with its adapters off (a model
    without adapters: itself, the starting weights when precomputing)."""
    if copy:
        logps = sequence_logps(model.reference, batch)[0]
    else:
        with adapters_off(model):
            logps = sequence_logps(model, batch)[0]
    return lax.stop_gradient(logps)


def with_reference(model, batch: Mapping, *, copy: bool) -> dict:
    """``batch`` with the reference's log-probs of its rows (``ref_logps``)."""
    batch, _ = without_reference(batch)
    return {**batch, REFERENCE_KEY: reference_logps(model, batch, copy=copy)}


def _pairs_of(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x[0::2], x[1::2]


def _check_rows(rows: int) -> None:
    if rows % 2:
        raise ConfigError(
            f"data.batch_size: a device's micro-batch holds {rows} rows, but a preference "
            "pair's chosen and rejected rows must stay together: use a data.batch_size that "
            "is a multiple of 2 x the devices splitting the batch x train.grad_accum")


def preference_loss(model, batch: Mapping, *, config: PreferenceConfig,
                    reference: Callable[[Any, Mapping], jax.Array] | None) -> tuple:
    """``(loss sum, pair count, {metric: sum})`` of ``config.method`` on ``batch``.

    A pair counts when both its rows have an answer token (a padding pair of a short eval
    split has none). ``reference(model, batch)`` gives the reference's log-probs where they
    are not in the batch. Under a ``context`` axis every device of a group computes its
    rows' whole-sequence losses (:func:`zjax.models.sequence_logps` sums over the axis) and
    reports ``1/C`` of them, which the step's sums over ``context`` add back up.
    """
    batch, ref = without_reference(batch)
    _check_rows(batch["tokens"].shape[0])
    if ref is None and config.source != "none":  # (a trainable's step adds them first)
        if reference is None:
            raise ConfigError(
                "preference.reference: precompute, but the batch carries no precomputed "
                f"{REFERENCE_KEY} (a loop's data must add them; the built-in loops do)")
        ref = reference(model, batch)
    logps, counts, stats = sequence_logps(model, batch)
    (c, r), (nc, nr) = _pairs_of(logps), _pairs_of(counts)
    refs = (None, None) if config.source == "none" else _pairs_of(ref.astype(jnp.float32))
    valid = ((nc > 0) & (nr > 0)).astype(jnp.float32)
    # a pair with no answer token (eval padding) gets harmless stand-ins: its loss is dropped
    # below, but a NaN in the branch it takes would still reach the gradient
    safe = lambda x: None if x is None else jnp.where(valid > 0, x, -1.0)
    c, r, refs = safe(c), safe(r), tuple(map(safe, refs))
    losses, metrics = pair_losses(Pairs(c, r, nc, nr, *refs), config)
    share = 1.0 / model_axis_size(CONTEXT)
    loss_sum = jnp.sum(jnp.where(valid > 0, losses, 0.0)) * share
    count = jnp.sum(valid) * share
    sums = {k: jnp.sum(jnp.where(valid > 0, v, 0.0)) * share for k, v in metrics.items()}
    if stats is not None:  # a mixture's router losses, per pair as the loss is
        loss_sum, count, router = router_losses(stats, loss_sum, count, model.cfg)
        sums |= router
    return loss_sum, count, sums
