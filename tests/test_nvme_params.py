"""Parameters on NVMe (``zero.offload_param.device: nvme``): the streamed step trains as the
one-program step does, its checkpoints move to and from in-memory runs, and what it does not
run is refused by key."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import ROOT, assert_trees_close, latest_checkpoint, nvme_overrides

import zjax
from zjax.checkpoint import to_canonical
from zjax.config import load_config
from zjax.errors import ConfigError

# float32 gathers and clipping (the step's global norm), 2 layers, short rows
BASE = ["zero.gather_dtype=float32", "data.path=", "model.n_layers=2", "data.seq_len=32",
        "optimizer.clip_norm=1.0", "train.steps=5"]
PARAMS = ["zero.offload_param.device=nvme"]


def _steps(file: str, overrides: list[str], *, rows: int, steps: int = 5):
    """``(metrics per step, canonical state as numpy)`` of ``steps`` steps from seed 0."""
    zstep = zjax.build_step(load_config(ROOT / file, overrides))
    try:
        state, rng, out = zstep.init(jax.random.key(0)), np.random.default_rng(0), []
        for _ in range(steps):
            batch = zstep.put_batch(rng.integers(0, 256, (rows, 33), dtype=np.int32))
            state, m = zstep.step(state, batch)
            out.append({k: float(m[k]) for k in ("loss", "grad_norm", "param_norm")})
        out.append({"eval": float(zstep.evaluate(state.params, batch))})
        return out, jax.tree.map(np.asarray, to_canonical(state, zstep))
    finally:
        zstep.close()


@pytest.mark.parametrize("file, extra, rows", [
    ("configs/tiny.yaml", [], 8),
    # the Llama block (rotary, grouped-query attention, SwiGLU) and two micro-batches
    pytest.param("configs/llama-tiny.yaml", ["train.grad_accum=2"], 16,
                 marks=pytest.mark.slow),
], ids=["gpt", "llama-accum"])
def test_five_steps_equal_the_in_memory_run(tmp_path, file, extra, rows):
    """Five steps with parameters and optimizer state on NVMe: the losses, norms, the
    evaluation after them, and the final master params and Adam moments equal the in-memory
    step's (relative 1e-5: sums over layers and devices in another order)."""
    overrides = [*BASE, *extra, f"data.batch_size={rows}"]
    ref, ref_state = _steps(file, overrides, rows=rows)
    got, state = _steps(file, [*overrides, *nvme_overrides(tmp_path, 4096), *PARAMS],
                        rows=rows)
    for a, e in zip(got, ref, strict=True):
        for k in e:
            assert a[k] == pytest.approx(e[k], rel=1e-5), (k, got, ref)
    assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6, what="state", scaled=True)
    assert not list(tmp_path.iterdir()), "swap files left behind"


@pytest.mark.slow  # four short runs
def test_checkpoints_move_between_streamed_and_in_memory_runs(tmp_path):
    """A streamed run's checkpoint resumes in memory, an in-memory one streamed: each ends
    at step 4 as a run never stopped (relative 1e-5)."""
    nv = tmp_path / "nv"
    nv.mkdir()
    common = [*BASE, "model.n_layers=2", "train.log_every=2", "train.eval_every=0",
              "logging.tensorboard=false", "checkpoint.every=2", "data.batch_size=8"]
    stream = [*nvme_overrides(nv, 4096), *PARAMS]

    def train(run, *extra):
        cfg = load_config(ROOT / "configs/tiny.yaml", [*common, *extra])
        zjax.train("lm", cfg, run_dir=tmp_path / run)

    train("ref", "train.steps=4", "data.path=")
    train("a", "train.steps=2", *stream)
    train("a", "train.steps=4")
    train("b", "train.steps=2")
    train("b", "train.steps=4", *stream)
    _, ref = latest_checkpoint(tmp_path / "ref", common)
    for run in ("a", "b"):
        step, got = latest_checkpoint(tmp_path / run, common)
        assert step == 4
        assert_trees_close(got, ref, rtol=1e-5, atol=1e-6, what=run, scaled=True)


@pytest.mark.parametrize("extra, match", [
    (["zero.stage=2"], r"zero\.offload_param\.device: nvme streams stage 3's .* zero\.stage "
                       r"is 2"),
    (["zero.offload_optimizer.device=host"],
     r"zero\.offload_param\.device: nvme needs zero\.offload_optimizer\.device: nvme "
     r"\(got 'host'\)"),
    (["zero.offload_param.nvme_path=/elsewhere"], r"zero\.offload_param\.nvme_path: "
                                                  r"'/elsewhere' differs"),
], ids=["stage-2", "optimizer-on-host", "two-paths"])
def test_what_the_stream_cannot_take_is_refused_by_key(tmp_path, extra, match):
    overrides = [*BASE, *nvme_overrides(tmp_path, 4096), *PARAMS, *extra]
    with pytest.raises(ConfigError, match=match):
        zjax.build_step(load_config(ROOT / "configs/tiny.yaml", overrides))


def test_a_layer_over_the_buffer_and_adapters_are_refused_by_key(tmp_path):
    """A layer's shards must fit one ``buffer_size``; LoRA's frozen base is not streamed."""
    stream = [*BASE, *nvme_overrides(tmp_path, 4096), *PARAMS]
    zstep = zjax.build_step(load_config(ROOT / "configs/tiny.yaml",
                                        [*stream, "zero.offload_param.buffer_size=1000"]))
    try:
        state = zstep.init(jax.random.key(0))
        batch = zstep.put_batch(np.zeros((8, 33), np.int32))
        with pytest.raises(ConfigError, match=r"zero\.offload_param\.buffer_size: one layer "
                                              r"of blocks is 196,864 elements"):
            zstep.step(state, batch)
    finally:
        zstep.close()
    with pytest.raises(ConfigError, match=r"zero\.offload_param\.device: nvme .* a frozen "
                                          r"base \(lora\.rank\)"):
        zjax.build_step(load_config(ROOT / "configs/tiny.yaml", [*stream, "lora.rank=4"]))
