"""ShardPlan: placements, shard shapes, and bytes that match the compiled step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compile_on
from hypothesis import given, settings
from hypothesis import strategies as st
from models import gpt_trainable

import zjax
from zjax.partition import nbytes

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

S = jax.ShapeDtypeStruct


def test_leaf_placement_rules():
    params = {
        "w": S((64, 256), jnp.float32),  # largest divisible dim: 1
        "stacked": S((8, 24, 16), jnp.float32),  # never dim 0; 24 is the largest divisible
        "small": S((16,), jnp.float32),  # persistent
        "odd": S((27, 15), jnp.float32),  # no dim divisible by 8
        "ids": S((64,), jnp.int32),  # not a float
    }
    plan = zjax.make_plan(params, zjax.ZeroConfig(stage=3, param_persistence_threshold=100),
                          zjax.make_mesh(), stacked=lambda p: p == "stacked")
    by = plan.leaves_by_path
    assert by["w"].dim == 1
    assert by["stacked"].dim == 1 and by["stacked"].stacked
    assert by["small"].dim is None and "persistent" in by["small"].reason
    assert by["odd"].dim is None and "divisible" in by["odd"].reason
    assert by["ids"].dim is None
    assert {leaf.path for leaf in plan.replicated} == {"small", "odd", "ids"}


def test_stage3_with_nothing_to_shard_is_a_config_error():
    params = {"w": S((16, 16), jnp.float32)}
    with pytest.raises(zjax.ConfigError, match="param_persistence_threshold"):
        zjax.make_plan(params, zjax.ZeroConfig(stage=3, param_persistence_threshold=10**6),
                       zjax.make_mesh())


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 3, 8, 16, 24, 40, 64]), min_size=1, max_size=4),
    stacked=st.booleans(),
    threshold=st.sampled_from([0, 64, 1000]),
)
def test_chosen_dim_is_valid(shape, stacked, threshold):
    shape = tuple(shape)
    stacked = stacked and len(shape) > 1
    plan = zjax.make_plan({"x": S(shape, jnp.float32)},
                          zjax.ZeroConfig(stage=2, param_persistence_threshold=threshold),
                          zjax.make_mesh(), stacked=lambda p: stacked)
    leaf = plan.leaves[0]
    per_layer = int(np.prod(shape[1:] if stacked else shape))
    if leaf.dim is None:
        first = 1 if stacked else 0
        assert per_layer < threshold or all(d % 8 for d in shape[first:])
    else:
        assert shape[leaf.dim] % 8 == 0
        assert not (stacked and leaf.dim == 0)
        assert per_layer >= threshold
        first = 1 if stacked else 0
        assert shape[leaf.dim] == max(d for d in shape[first:] if d % 8 == 0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shards_and_bytes_match_compiled_step(stage):
    zero = zjax.ZeroConfig(stage=stage, gather_dtype="bfloat16", param_persistence_threshold=100)
    tx = optax.adamw(1e-3)
    zstep = zjax.make_step(gpt_trainable(), tx, zero=zero, mesh=zjax.make_mesh())
    state = zstep.init(jax.random.key(0))
    n = 8
    # every sharded param / optimizer leaf holds 1/N of its elements per device
    sharded = {leaf.path for leaf in zstep.plan.leaves if leaf.dim is not None}
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    for (_, x), leaf in zip(flat, zstep.plan.leaves, strict=True):
        shard = x.addressable_shards[0].data.shape
        if stage == 3 and leaf.path in sharded:
            assert np.prod(shard) * n == np.prod(x.shape), leaf.path
        else:
            assert shard == x.shape, leaf.path
    mu = state.opt_state[0].mu
    for x, leaf in zip(jax.tree.leaves(mu), zstep.plan.leaves, strict=True):
        expect = x.size // n if stage >= 1 and leaf.dim is not None else x.size
        assert x.addressable_shards[0].data.size == expect, leaf.path
    # plan bytes == compiled argument bytes (state + batch)
    batch = jax.ShapeDtypeStruct((16, 17), jnp.int32)
    compiled = compile_on(zstep.lower(batch))
    state_bytes = nbytes(zstep.abstract_state)
    batch_bytes = 16 // n * 17 * 4
    assert compiled.memory_analysis().argument_size_in_bytes == state_bytes + batch_bytes
    if stage == 3:
        total = sum(leaf.size * 4 for leaf in zstep.plan.leaves)
        replicated = sum(leaf.size * 4 for leaf in zstep.plan.replicated)
        params_bytes = nbytes(zstep.abstract_state.params)
        assert params_bytes == (total - replicated) // n + replicated


def test_opt_specs_follow_params_in_a_chain():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    zstep = zjax.make_step(gpt_trainable(), tx, zero=zjax.ZeroConfig(stage=1),
                           mesh=zjax.make_mesh())
    opt = zstep.state_shardings.opt_state
    count = opt[1][0].count
    assert count.spec == jax.sharding.PartitionSpec()
    embed = opt[1][0].mu["embed"]
    assert embed.spec == zstep.plan.leaves_by_path["embed"].spec
