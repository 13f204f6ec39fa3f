"""TPU quirks of zjax's backend record, each measured against the same step compiled
without it (v5p:2x2x2 through libtpu, deviceless; nothing runs on a TPU).

A file of its own so that the test workers run it beside ``test_targets.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import TARGET_BASE, compile_on, compiled_for, sharded_params

import zjax
from zjax.runtime import _backend
from zjax.runtime._backend import backend
from zjax.runtime.targets import target

TPU = "v5p:2x2x2"

# layers big enough that the compilers overlap their gathers (as test_targets.py's overlap test)
WIDE = ("zero.stage=3", "model.d_model=512", "model.d_ff=2048", "model.n_layers=4",
        "zero.reduce_dtype=bfloat16")


def _temp_without(quirk: str, *overrides: str, monkeypatch) -> int:
    """Temp of the tiny GPT's step compiled for v5p with the TPU record's ``quirk`` off."""
    monkeypatch.setitem(_backend._BACKENDS, "tpu",
                        dataclasses.replace(backend("tpu"), **{quirk: None}))
    config = zjax.load_config("configs/tiny.yaml", [*TARGET_BASE, *overrides])
    compiled = compile_on(zjax.build_step(config, target(TPU)).lower(zjax.abstract_batch(config)),
                          target(TPU).devices)
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_tpu_casts_each_layer_inside_the_loops(monkeypatch):
    """libtpu moves a layer's float32 -> bf16 convert out of the layer loops and holds the
    whole stack in bf16 through them; rounding first (``Backend.hoists_loop_casts``) keeps
    it per layer and saves that copy of the stack's shards."""
    overrides = (*WIDE, "zero.prefetch_layers=1")
    zstep, kept, _ = compiled_for(TPU, *overrides)
    plan = zstep.plan
    stack_bf16 = sum(leaf.size for leaf in plan.leaves
                     if leaf.stacked and leaf.dim is not None) // plan.n_data * 2
    saved = (_temp_without("hoists_loop_casts", *overrides, monkeypatch=monkeypatch)
             - kept.memory_analysis().temp_size_in_bytes)
    assert saved >= 0.9 * stack_bf16, (saved, stack_bf16)


@pytest.mark.slow
def test_tpu_prefetch_arrives_before_the_vjp(monkeypatch):
    """libtpu keeps the backward's prefetch in flight across its layer's VJP, where the step
    peaks, unless the prefetch is tied to the VJP's cotangent (``Backend.prefetch_before_vjp``):
    the tie takes that gathered layer out of the peak: it saves 6.1 MB against a 6.3 MB layer
    on ``WIDE`` at prefetch 1 (the step ``test_tpu_casts_each_layer_inside_the_loops``
    compiles: one compile shared; 8.6 MB before the gradient stack stayed in bf16, which
    lowered both peaks). At d_model 1024 and 4k tokens per device it is 45 against 25 MB, but
    each of the two compiles takes over a minute."""
    overrides = (*WIDE, "zero.prefetch_layers=1")
    zstep, tied, _ = compiled_for(TPU, *overrides)
    layer = sharded_params(zstep, layer=True) * 2  # bf16
    saved = (_temp_without("prefetch_before_vjp", *overrides, monkeypatch=monkeypatch)
             - tied.memory_analysis().temp_size_in_bytes)
    assert saved >= 0.9 * layer, (saved, layer)
