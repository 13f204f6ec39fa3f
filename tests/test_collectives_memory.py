"""Stage 3 from the compiled program: collective bytes and a bounded gathered working set."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax.hlo import collective_bytes
from zjax.models import GPT, GPTConfig, lm_loss

BATCH = jax.ShapeDtypeStruct((16, 65), jnp.int32)


@functools.cache
def compiled_step(n_layers: int, prefetch: int = 1, gather: str = "bfloat16",
                  reduce: str = "float32"):
    cfg = GPTConfig(vocab_size=256, d_model=128, n_layers=n_layers, n_heads=4, d_ff=512,
                    max_seq_len=64)
    trainable = zjax.from_nnx(lambda rngs: GPT(cfg, rngs=rngs), lm_loss)
    zero = zjax.ZeroConfig(stage=3, gather_dtype=gather, reduce_dtype=reduce,
                           prefetch_layers=prefetch)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    zstep = zjax.make_step(trainable, tx, zero=zero, mesh=zjax.make_mesh())
    return zstep, zstep.lower(BATCH).compile()


@pytest.mark.parametrize(("gather", "reduce"), [("bfloat16", "float32"), ("float32", "float32")])
def test_stage3_collective_bytes(gather, reduce):
    zstep, compiled = compiled_step(8, 1, gather, reduce)
    psi = sum(leaf.size for leaf in zstep.plan.leaves if leaf.dim is not None)
    cb = collective_bytes(compiled.as_text())
    expect_ag = 2 * psi * np.dtype(gather).itemsize
    expect_rs = psi * np.dtype(reduce).itemsize
    assert abs(cb.all_gather - expect_ag) <= 0.02 * expect_ag, (cb, expect_ag)
    assert abs(cb.reduce_scatter - expect_rs) <= 0.02 * expect_rs, (cb, expect_rs)
    # only the persistent leaves' gradients and a few scalars (loss, count, norms) are all-reduced
    persistent = sum(leaf.size for leaf in zstep.plan.replicated) * 4
    assert persistent <= cb.all_reduce <= persistent + 256


def test_stage3_temp_memory_flat_in_depth():
    temps = {}
    for n_layers in (4, 8, 16, 32):
        zstep, compiled = compiled_step(n_layers)
        temps[n_layers] = compiled.memory_analysis().temp_size_in_bytes
    cfg_layer = [leaf for leaf in zstep.plan.leaves if leaf.stacked]
    layer_bytes = sum(leaf.size // leaf.shape[0] for leaf in cfg_layer) * 2  # bf16 gathered
    layers = sorted(temps)
    for a, b in itertools.pairwise(layers):
        per_layer = (temps[b] - temps[a]) / (b - a)
        assert per_layer < layer_bytes, (temps, layer_bytes)


def test_prefetch_grows_working_set_by_about_a_layer_each():
    base = compiled_step(8, 0)[1].memory_analysis().temp_size_in_bytes
    zstep, c2 = compiled_step(8, 2)
    layer_bytes = sum(leaf.size // leaf.shape[0] for leaf in zstep.plan.leaves if leaf.stacked) * 2
    extra = c2.memory_analysis().temp_size_in_bytes - base
    assert extra <= 3 * layer_bytes, (extra, layer_bytes)
