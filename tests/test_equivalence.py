"""Sharded training equals single-device optax (the core ZeRO invariant)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FP32,
    adam_moments,
    assert_matches_reference,
    assert_trees_close,
    make_tx,
    reference_run,
    train_steps,
)
from models import gpt_reference_loss, gpt_trainable, linen_trainable, token_batches

import zjax

CASES = [(s, 1, t) for s in (0, 1, 2) for t in (0, 100)] + [
    (3, p, t) for p in (0, 1, 2) for t in (0, 100)
]


# the fast loop (-m "not slow") keeps one case: stage 3, prefetch 1, every leaf sharded
@pytest.mark.parametrize(("stage", "prefetch", "threshold"), [
    pytest.param(*c, marks=() if c == (3, 1, 0) else pytest.mark.slow) for c in CASES])
def test_gpt_matches_single_device(gpt_reference, stage, prefetch, threshold):
    batches, reference = gpt_reference
    zero = zjax.ZeroConfig(stage=stage, prefetch_layers=prefetch,
                           param_persistence_threshold=threshold,
                           gather_dtype="float32", reduce_dtype="float32")
    zstep, state, losses = train_steps(gpt_trainable(), zero, batches)
    assert (len(zstep.plan.replicated) > 0) == (threshold > 0 or stage == 0)
    assert_matches_reference(losses, state, reference)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_grad_accumulation_matches(gpt_reference, stage):
    batches, (ref_params, _, ref_losses) = gpt_reference
    zero = zjax.ZeroConfig(stage=stage, gather_dtype="float32", param_persistence_threshold=100)
    _, state, losses = train_steps(gpt_trainable(), zero, batches, micro_batches=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_params, **FP32, what="params")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_gather_losses_within_one_percent(stage):
    batches = token_batches(20, seed=1)
    trainable = gpt_trainable()
    _, _, ref_losses = reference_run(trainable.init, gpt_reference_loss(), make_tx(), batches)
    zero = zjax.ZeroConfig(stage=stage, gather_dtype="bfloat16", reduce_dtype="bfloat16",
                           param_persistence_threshold=100)
    zstep, state, losses = train_steps(trainable, zero, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=0.01)
    assert losses[-1] < losses[0] * 0.9, "bf16 training did not learn"
    if stage < 3:  # working copy in bf16, float32 master sharded like the optimizer state
        assert zstep.plan.has_master
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.master))
    else:  # no working copy at stage 3: the float32 master shards are the params
        assert state.master is None
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_model_through_pytree_api(stage):
    trainable, init, loss = linen_trainable()
    batches = token_batches(5, seed=2)
    ref_params, ref_opt, ref_losses = reference_run(init, loss, make_tx(), batches)
    zero = zjax.ZeroConfig(stage=stage, gather_dtype="float32", param_persistence_threshold=100)
    zstep, state, losses = train_steps(trainable, zero, batches)
    if stage == 3:
        assert zstep.plan.leaves_by_path["embed/embedding"].dim is not None
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_params, **FP32, what="params")
    assert_trees_close(adam_moments(state.opt_state)[0], adam_moments(ref_opt)[0], **FP32,
                       what="mu")
