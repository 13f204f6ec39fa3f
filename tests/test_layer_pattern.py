"""Layers that differ by index (Gemma 2/3: sliding-window layers with their own rotary base
between global ones, soft-capped attention and logits, post norms) train the same under
every layer loop: the plain scan (stage 0), the scheduled gather loop (stage 3, its saved
inputs on device or host), and stages 1-2's kept-input loop whose inputs are on the host or
split over ``model``.

Losses over three steps are compared at rtol 1e-6 (float32 gathers and reductions: the
loops sum in different orders); the second and third losses carry the gradients."""

import numpy as np
import pytest
from helpers import config_losses

PATTERN = ["model.n_layers=4", "model.sliding_window=16", "model.global_every=2",
           "model.local_rope_theta=100", "model.attn_softcap=20", "model.final_softcap=5",
           "model.post_norms=true", "model.query_pre_attn_scalar=16", "data.seq_len=64",
           "data.batch_size=8", "zero.param_persistence_threshold=0",
           "zero.gather_dtype=float32", "zero.reduce_dtype=float32"]


def _losses(overrides: list[str]) -> list[float]:
    return config_losses("configs/llama-tiny.yaml", [*PATTERN, *overrides], steps=3)


@pytest.fixture(scope="module")
def scanned() -> list[float]:
    return _losses(["zero.stage=0"])


@pytest.mark.parametrize("loop", [  # the quick loop keeps stage 3's loop
    ["zero.stage=3"],
    *(pytest.param(loop, marks=pytest.mark.slow) for loop in (
        ["zero.stage=3", "model.attention=blockwise"],
        ["zero.stage=3", "zero.offload_activations=true"],
        ["zero.stage=2", "zero.offload_activations=true"],
        ["zero.stage=2", "zero.partition_activations=true", "mesh.model=2", "mesh.data=4"]))])
def test_every_layer_loop_trains_the_pattern_as_the_plain_scan(scanned, loop):
    np.testing.assert_allclose(_losses(loop), scanned, rtol=1e-6)


def test_the_global_layers_are_global(scanned):
    """Without ``global_every`` every layer is windowed: a different model, a different loss
    (so the loops above are not all passing one index)."""
    local = _losses(["zero.stage=0", "model.global_every=null", "model.local_rope_theta=null"])
    assert abs(local[0] - scanned[0]) > 1e-4
