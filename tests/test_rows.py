"""Embedding rows looked up where they live (``zjax.partition.rows``): the lookup equals
``jnp.take`` of the whole table, forward and backward, and at stage 3 a vocabulary-sharded
table is no longer gathered whole when the step's tokens are fewer than its rows."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import zjax
from zjax.config import load_config
from zjax.partition import Comm
from zjax.partition.rows import Rows, take_rows


def test_a_lookup_where_the_rows_live_is_take_of_the_whole_table_and_so_is_its_gradient():
    """8 devices, each holding 8 of a 64-row table and looking up its own 2 x 3 ids (rows on
    every device, repeated ones): the rows are ``jnp.take``'s exactly (one device holds each
    row), the table's gradient too, to float32's rounding."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    k = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(k[0], (64, 6), jnp.float32)
    ids = jax.random.randint(k[1], (8 * 2, 3), 0, 64).at[0, :2].set(7)
    weights = jax.random.normal(k[2], (8 * 2, 3, 6), jnp.float32)
    comm = Comm(axis_name="data", gather_dtype=jnp.float32)

    rows = jax.shard_map(lambda s, i: take_rows(Rows(s, comm, 64), i), mesh=mesh,
                         in_specs=(P("data"), P("data")), out_specs=P("data"))

    def loss(t, *, sharded: bool):
        looked_up = rows(t, ids) if sharded else jnp.take(t, ids, axis=0)
        return jnp.sum(looked_up * weights)

    np.testing.assert_array_equal(rows(table, ids), jnp.take(table, ids, axis=0))
    # a repeated row's gradients are summed in another order: float32 rounding apart
    np.testing.assert_allclose(jax.grad(lambda t: loss(t, sharded=True))(table),
                               jax.grad(lambda t: loss(t, sharded=False))(table), rtol=1e-6)


def _step(batch: int, seq: int, stage: int):
    config = load_config(ROOT / "configs/llama-tiny.yaml",
                         ["data.path=", "model.n_layers=2", "zero.gather_dtype=float32",
                          f"zero.stage={stage}", f"data.batch_size={batch}",
                          f"data.seq_len={seq}"])
    return config, zjax.build_step(config)


def _losses(zstep, batch: int, seq: int) -> list[float]:
    state = zstep.init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 256, (batch, seq + 1)).astype(np.int32)
    out = []
    for _ in range(3):
        state, m = zstep.step(state, zstep.put_batch(tokens))
        out.append(float(m["loss"]))
    return out


def _table_gathers(zstep, config) -> int:
    """The step's all-gathers of the whole 256 x 128 float32 embedding table (its bits)."""
    hlo = zstep.lower(zjax.abstract_batch(config)).compile().as_text()
    return len(re.findall(r"= u32\[256,128\]\{[^}]*\} all-gather", hlo))


def test_stage3_looks_up_the_embedding_where_it_lives_and_trains_as_stage2():
    """128 tokens a step against 256 rows: stage 3 gathers ids and rows, not the table, and
    trains the losses stage 2 (whole params, a plain take) does; 2,048 tokens: the table is
    gathered whole again (cheaper than moving the rows)."""
    config, looked_up = _step(8, 16, 3)
    assert _table_gathers(looked_up, config) == 0
    _, stage2 = _step(8, 16, 2)
    assert _losses(looked_up, 8, 16) == pytest.approx(_losses(stage2, 8, 16), rel=1e-5)
    config, gathered = _step(16, 128, 3)
    assert _table_gathers(gathered, config) >= 1
