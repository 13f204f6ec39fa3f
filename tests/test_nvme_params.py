"""Parameters on NVMe (``zero.offload_param.device: nvme``): the streamed step trains as the
one-program step does, its checkpoints move to and from in-memory runs, and what it does not
run is refused by key."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from helpers import ROOT, assert_trees_close, latest_checkpoint, nvme_overrides, zjax_main

import zjax
from zjax.checkpoint import to_canonical
from zjax.config import load_config
from zjax.errors import ConfigError

# float32 gathers and clipping (the step's global norm), 2 layers, short rows
BASE = ["zero.gather_dtype=float32", "data.path=", "model.n_layers=2", "data.seq_len=32",
        "optimizer.clip_norm=1.0", "train.steps=5"]
PARAMS = ["zero.offload_param.device=nvme"]


def _steps(file: str, overrides: list[str], *, rows: int, steps: int = 5):
    """``(metrics per step, canonical state as numpy)`` of ``steps`` steps from seed 0; a
    streamed step's metrics add the bytes its gradients' files read and wrote, as a
    multiple of the Stacks' part of the files, and that part's share."""
    zstep = zjax.build_step(load_config(ROOT / file, overrides))
    try:
        state, rng, out = zstep.init(jax.random.key(0)), np.random.default_rng(0), []
        grads = getattr(zstep.nvme, "grads", None)  # the files are opened by init
        if grads:
            stacked = 4 * sum(sum(leaf.sizes) for leaf, p in zip(zstep.nvme.leaves,
                                                                  zstep.plan.leaves,
                                                                  strict=True) if p.stacked)
        for _ in range(steps):
            batch = zstep.put_batch(rng.integers(0, 256, (rows, 33), dtype=np.int32))
            moved = (grads.store.read_bytes, grads.store.written_bytes) if grads else None
            state, m = zstep.step(state, batch)
            out.append({k: float(m[k]) for k in ("loss", "grad_norm", "param_norm")})
            if grads:
                out[-1]["grad_files"] = ((grads.store.read_bytes - moved[0]) / stacked,
                                         (grads.store.written_bytes - moved[1]) / stacked,
                                         stacked / grads.store.nbytes)
        out.append({"eval": float(zstep.evaluate(state.params, batch))})
        return out, jax.tree.map(np.asarray, to_canonical(state, zstep))
    finally:
        zstep.close()


@pytest.mark.parametrize("file, extra, rows", [
    ("configs/tiny.yaml", [], 8),
    # no clipping: each layer's gradients go straight into the update during the backward
    # (the first micro-batch's through the gradient files)
    ("configs/tiny.yaml", ["optimizer.clip_norm=", "train.grad_accum=2"], 16),
    # the Llama block (rotary, grouped-query attention, SwiGLU), a dense first layer before
    # three of a mixture (two Stack calls: the second segment takes the first call's output;
    # the router statistics ride the residual stream, past the host's two layers ahead), two
    # micro-batches
    pytest.param("configs/llama-tiny.yaml", ["train.grad_accum=2", "model.n_layers=4",
                                             "model.n_experts=4", "model.first_k_dense=1"],
                 16, marks=pytest.mark.slow),
    # tensor parallelism: data 4 x model 2
    pytest.param("configs/tiny-tp.yaml", [], 8, marks=pytest.mark.slow),
], ids=["gpt", "gpt-overlap-accum", "llama-moe-accum", "tp"])
def test_five_steps_equal_the_in_memory_run(tmp_path, file, extra, rows):
    """Five steps with parameters and optimizer state on NVMe: the losses, norms, the
    evaluation after them, and the final master params and Adam moments equal the in-memory
    step's (relative 1e-5: sums over layers and devices in another order)."""
    overrides = [*BASE, *extra, f"data.batch_size={rows}"]
    ref, ref_state = _steps(file, overrides, rows=rows)
    got, state = _steps(file, [*overrides, *nvme_overrides(tmp_path, 4096), *PARAMS],
                        rows=rows)
    # the gradients' files: each micro-batch's sums of the Stacks' layers written and read
    # back (by the next micro-batch, by the update), the rest summed on the devices and
    # written once; without a clip the last micro-batch's go straight into the update
    micro = int(next((o.split("=")[1] for o in extra if o.startswith("train.grad_accum=")), 1))
    share = got[0]["grad_files"][2]
    through = (micro - 1 if "optimizer.clip_norm=" in extra else micro + (1 - share) / share)
    for m in got[:-1]:
        assert m["grad_files"][:2] == (pytest.approx(through),) * 2, got
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


# planned, never run: the swap files' path is only opened by a run
PLANNED = ["zero.offload_param.device=nvme", "zero.offload_optimizer.device=nvme",
           "zero.offload_optimizer.nvme_path=/plans/never/open/it", "data.path=",
           "zero.offload_activations=true"]


@pytest.mark.parametrize("where", ["cpu", "h100:8", pytest.param("v5p:2x2x2",
                                                                   marks=pytest.mark.slow)])
def test_device_memory_is_flat_in_depth(where):
    """The tiny GPT at 32 layers against 8, its saved layer inputs in host memory: the same
    device peak (the issue asks at most 1.1x) from the same per-layer programs; the host
    temp is the saved inputs exactly (L x 2 rows x 128 tokens x 128 x bf16 per device); the
    compiled collectives grow by two gathers (bf16) and one reduce-scatter (float32) of each
    added layer's sharded weights and one all-reduce of its persistent norms (float32)."""
    plans = {n: zjax.plan(load_config(ROOT / "configs/tiny.yaml",
                                      [*PLANNED, f"model.n_layers={n}"]),
                          target=None if where == "cpu" else where) for n in (8, 32)}
    d8, d32 = plans[8].per_device, plans[32].per_device
    assert d32["total_bytes"] == d8["total_bytes"]
    assert d32["host_temp_bytes"] == 32 * 2 * 128 * 128 * 2
    sharded, norms = 4 * 128 * 128 + 2 * 128 * 512, 2 * 128  # elements of one layer
    c8, c32 = plans[8].collectives, plans[32].collectives
    assert c32["all_gather_bytes"] - c8["all_gather_bytes"] == 24 * 2 * sharded * 2
    assert c32["reduce_scatter_bytes"] - c8["reduce_scatter_bytes"] == 24 * sharded * 4
    assert c32["all_reduce_bytes"] - c8["all_reduce_bytes"] == 24 * norms * 4
    # NVMe a step, per device: each layer's own float32 shards read forward and backward,
    # its master, 2 moments and gradient read by the update, master and moments written
    # with the gradient
    layer = 4 * (sharded // 8 + norms)
    assert d32["nvme_read_bytes"] - d8["nvme_read_bytes"] == 24 * layer * (2 + 3 + 1)
    assert d32["nvme_written_bytes"] - d8["nvme_written_bytes"] == 24 * layer * (3 + 1)


@pytest.mark.slow  # the moonshot's programs, compiled for an H100 node
def test_a_trillion_parameters_fit_one_h100_node_with_nvme():
    """``zjax plan configs/llama-1t.yaml --target h100:8`` with parameters and optimizer on
    NVMe, one 4096-token sequence per GPU: it fits, and prints each GPU's device memory, the
    host memory beside it and the NVMe bytes a step moves."""
    proc = zjax_main("plan", "configs/llama-1t.yaml", "--target", "h100:8",
                     "zero.offload_param.device=nvme", "zero.offload_optimizer.device=nvme",
                     "zero.offload_optimizer.nvme_path=/local_nvme", "data.batch_size=8",
                     "zero.offload_param.buffer_size=6000000000", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    d = report["per_device"]
    assert report["n_params"] > 1e12 and report["fits_device"]
    assert d["total_bytes"] <= d["capacity_bytes"]
    # the float32 master, Adam's two moments and the gradients, a GPU's shard of each
    assert d["nvme_bytes"] == pytest.approx(16 * report["n_params"] / 8, rel=1e-3)
    assert d["host_temp_bytes"] == 168 * 4096 * 20480 * 2  # the saved layer inputs
    assert d["nvme_read_bytes"] > d["nvme_written_bytes"] > 0 and d["stream_host_bytes"] > 0


def test_cli_exits_2_naming_the_path_before_any_state(tmp_path):
    """A missing ``nvme_path``: exit 2, the key and the path named, no checkpoint written
    and no swap files anywhere."""
    run = tmp_path / "run"
    proc = zjax_main("train", "configs/tiny.yaml", *BASE, *nvme_overrides(tmp_path / "nope"),
                     *PARAMS, "--run-dir", str(run))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"zero\.offload_optimizer\.nvme_path: '.*nope' does not exist",
                     proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list((run / "checkpoints").glob("[0-9]*")) and not list(tmp_path.rglob("*.swp"))


def test_a_step_stopped_mid_update_leaves_files_no_step_or_save_reads(tmp_path, monkeypatch):
    """Without a clip the update writes master and moments during the backward: a step
    stopped there leaves the swap files holding neither step. The next step and any save
    refuse them, naming why, instead of training or saving a half-stepped model."""
    from zjax.errors import NvmeError
    from zjax.step import _stream_update

    config = load_config(ROOT / "configs/tiny.yaml", [
        *BASE, "optimizer.clip_norm=", "data.batch_size=8", *nvme_overrides(tmp_path, 4096),
        *PARAMS])
    zstep = zjax.build_step(config)
    try:
        state = zstep.init(jax.random.key(0))
        batch = zstep.put_batch(np.random.default_rng(0).integers(0, 256, (8, 33),
                                                                    dtype=np.int32))
        put, calls = _stream_update.Handoff.put, []

        def failing(self, *args, **kwargs):
            calls.append(self.run is not None)
            if self.run is not None and calls.count(True) == 3:
                raise OSError(28, "No space left on device")
            return put(self, *args, **kwargs)

        monkeypatch.setattr(_stream_update.Handoff, "put", failing)
        with pytest.raises(OSError, match="No space"):
            zstep.step(state, batch)
        monkeypatch.setattr(_stream_update.Handoff, "put", put)
        with pytest.raises(NvmeError, match=r"mid-update .*No space"):
            zstep.step(state, batch)
        with pytest.raises(NvmeError, match="mid-update"):
            dict(zstep.storage.leaves(state))
    finally:
        zstep.close()
