"""Long context: activation memory linear in the sequence on every compiler, the 8B template
at 4 x 8192 tokens per device on an H100 slice, and ZeRO-R's saved inputs in host memory or
split over ``model`` (values unchanged; the host bytes are exactly the saved inputs').

Memory figures are ``memory_analysis()`` of the step compiled from ``ShapeDtypeStruct``s.
"""

import numpy as np
import pytest
from helpers import compile_on, config_losses

import zjax
from zjax.runtime.targets import target

# the long-context probe (configs/llama3-8b.yaml shrunk): 2 layers, d_model 1024,
# GQA 16/4, 16384 tokens per device. At half its width and tokens v5p's temp grows 19% from
# 2048 to 8192 (353 -> 419 MB: a fixed ~66 MB, not the attention, whose own temp falls)
PROBE = ["model.n_layers=2", "model.d_model=1024", "model.n_heads=16", "model.n_kv_heads=4",
         "model.d_ff=4096", "model.vocab_size=32000", "model.max_seq_len=8192", "data.path="]
TOKENS = 16384


def _compiled(file: str, name: str, overrides: list[str]):
    config = zjax.load_config(file, overrides)
    where = None if name == "cpu" else target(name)
    zstep = zjax.build_step(config, where)
    return config, zstep, compile_on(zstep.lower(zjax.abstract_batch(config)),
                                     None if where is None else where.devices)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu", "h100:8", "v5p:2x2x2"])
def test_temp_at_8192_tokens_per_sequence_is_that_at_2048(name):
    """16384 tokens per device as 8 x 2048 and as 2 x 8192: with the default attention and
    loss the step's temp grows by at most 10% (dense attention and loss: 3.9x on H100)."""
    n = 8
    temps = [_compiled("configs/llama3-8b.yaml", name,
                       [*PROBE, f"data.seq_len={t}", f"data.batch_size={TOKENS * n // t}"])[2]
             .memory_analysis().temp_size_in_bytes for t in (2048, 8192)]
    assert temps[1] <= 1.10 * temps[0], temps


@pytest.mark.slow
def test_the_8b_template_fits_an_h100_slice_at_4_x_8192_tokens_per_device():
    """Its own settings only (was 104.7 GB of temp before the fused attention and the
    chunked loss)."""
    *_, compiled = _compiled("configs/llama3-8b.yaml", "h100:8x8",
                                   ["data.seq_len=8192", "data.batch_size=256", "data.path="])
    m = compiled.memory_analysis()
    assert m.temp_size_in_bytes <= 40e9, m.temp_size_in_bytes
    assert m.temp_size_in_bytes + m.argument_size_in_bytes <= target("h100:8x8").capacity_bytes


TINY = ["model.n_layers=4", "data.seq_len=64", "data.batch_size=8",
        "zero.param_persistence_threshold=0", "model.attention=blockwise"]


@pytest.mark.slow  # a v5p compile of about a minute
@pytest.mark.parametrize("name", ["v5p:2x2x2", "h100:8"])
def test_offloaded_layer_inputs_are_the_host_bytes_and_leave_the_device(name):
    """Host temp equals the saved layer inputs: 4 layers x [1, 2048, 512] bfloat16 per device
    (the residual stream in the gather dtype). The device temp is not asserted: it fell with
    auto attention at 4 x 2048 tokens per device (v5p 250 -> 212 MB, H100 203 -> 178 MB)
    but rose 12% on one target with blockwise (the transfer buffers): a known gap, not a
    guarantee."""
    sizes = ["data.seq_len=2048", "model.max_seq_len=2048", "data.batch_size=8",
             "model.d_model=512", "model.d_ff=1024"]
    config = zjax.load_config("configs/llama-tiny.yaml",
                              [*TINY, *sizes, "zero.offload_activations=true"])
    report = zjax.plan(config, target=name)
    # the compiler's host temp, and the plan's estimate of the saved inputs, both exactly
    assert report.per_device["host_temp_bytes"] == 4 * 1 * 2048 * 512 * 2
    assert report.activations["host_bytes"] == report.per_device["host_temp_bytes"]
    assert report.activations["saved_inputs_bytes"] == 0


def _losses(overrides: list[str], steps: int = 2):
    return config_losses("configs/llama-tiny.yaml", [*TINY, *overrides], steps=steps)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [["zero.offload_activations=true"],
                                  ["zero.partition_activations=true", "mesh.model=2",
                                   "mesh.data=4"]])
def test_training_with_inputs_on_the_host_or_partitioned_equals_training_without(keep):
    mesh = [o for o in keep if o.startswith("mesh.")]
    np.testing.assert_allclose(_losses(keep), _losses(mesh), rtol=1e-6)
