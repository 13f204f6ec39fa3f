"""Host offload: equal training, host placement, moves by memory space, checkpoints across modes."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import FP32, assert_trees_close
from models import gpt_trainable, token_batches

import zjax
from zjax.checkpoint import CheckpointConfig, Checkpointer, to_canonical
from zjax.export import export
from zjax.offload import OffloadConfig, OptimizerOffloadConfig
from zjax.partition import ZeroConfig, nbytes
from zjax.step.optim import clip_by_global_norm

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

TX = optax.chain(clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
OPT = OptimizerOffloadConfig(device="host")
OPT_ON_HOST = OptimizerOffloadConfig(device="host", update_on="host")
PARAM = OffloadConfig(device="host")
MODES = {
    "optimizer": dict(offload_optimizer=OPT),
    "optimizer-update-on-host": dict(offload_optimizer=OPT_ON_HOST),
    "param": dict(offload_param=PARAM),
    "both": dict(offload_optimizer=OPT_ON_HOST, offload_param=PARAM),
}
N_STEPS = 5


def _step(stage: int, *, micro_batches: int = 1, **offload) -> zjax.ZeroStep:
    zero = ZeroConfig(stage=stage, param_persistence_threshold=16, **offload)
    return zjax.make_step(gpt_trainable(), TX, zero=zero, mesh=zjax.make_mesh(),
                          micro_batches=micro_batches)


def _train(zstep: zjax.ZeroStep, n: int = N_STEPS):
    state = zstep.init(jax.random.key(0))
    for batch in token_batches(n):
        state, _ = zstep.step(state, zstep.put_batch(batch))
    return state


@pytest.fixture(scope="module")
def reference():
    """No offload, per stage, after N_STEPS (the runs every offload mode must equal)."""
    cache = {}

    def get(stage, micro_batches=1):
        if (stage, micro_batches) not in cache:
            zstep = _step(stage, micro_batches=micro_batches)
            cache[stage, micro_batches] = to_canonical(_train(zstep), zstep)
        return cache[stage, micro_batches]

    return get


# "both" updates on the host; each path (moments on the host, update on the host, master shards
# brought in per layer at stage 3, master brought in for the update at stages 1-2) is covered
@pytest.mark.parametrize(("stage", "mode"), [
    (3, "optimizer"), (3, "param"), (3, "both"), (2, "both"), (1, "param"),
])
def test_offload_trains_like_no_offload(reference, stage, mode):
    zstep = _step(stage, **MODES[mode])
    got = to_canonical(_train(zstep), zstep)
    want = reference(stage)
    assert_trees_close(got["params"], want["params"], **FP32, what="params")
    assert_trees_close(got["opt_state"], want["opt_state"], **FP32, what="optimizer state")


def test_param_offload_with_gradient_accumulation(reference):
    zstep = _step(3, micro_batches=2, **MODES["both"])
    got = to_canonical(_train(zstep), zstep)
    assert_trees_close(got["params"], reference(3, 2)["params"], **FP32, what="params")


def _kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _opt_kinds(opt_state) -> set[str]:
    """Memory kinds of the optimizer state's arrays; its step counts (scalars) must stay on
    the device (a host-resident count breaks TPU's aliasing)."""
    scalars = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(opt_state) if not leaf.ndim}
    assert scalars == {"device"}, f"optimizer step counts in {scalars}"
    return _kinds([leaf for leaf in jax.tree.leaves(opt_state) if leaf.ndim])


@pytest.mark.parametrize("mode", ["optimizer", "both"])
def test_offloaded_state_lives_and_moves_in_host_memory(mode):
    zstep = _step(3, **MODES[mode])
    state = _train(zstep, 1)
    assert _opt_kinds(state.opt_state) == {"pinned_host"}
    assert _kinds(state.params) == ({"pinned_host"} if mode == "both" else {"device"})
    n_params = sum(leaf.size for leaf in zstep.plan.leaves)
    sharded = sum(leaf.size // 8 if leaf.dim is not None else leaf.size
                  for leaf in zstep.plan.leaves)
    assert sharded < 1.03 * n_params / 8  # (almost) every leaf is sharded
    placed = {m: nbytes(zstep.abstract_state, memory=m) for m in ("device", "host")}
    offloaded = [x for x in jax.tree.leaves(zstep.abstract_state)
                 if x.sharding.memory_kind == "pinned_host"]
    assert all(x.ndim for x in offloaded)  # optax's counts stay on the device
    counts = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(zstep.abstract_state)
                 if x.ndim == 0)  # the step counter and optax's counts
    if mode == "optimizer":  # fp32 master on the device, Adam's two moments on the host
        assert placed["device"] == 4 * sharded + counts
        assert placed["host"] == 8 * sharded
    else:
        assert placed["device"] == counts
        assert placed["host"] == 12 * sharded

    batch = jax.ShapeDtypeStruct((16, 17), np.int32)
    compiled = zstep.lower(batch).compile()
    entry = compiled.as_text().split("\n", 1)[0]
    # every offloaded argument and result sits in host memory space S(5) in the entry layout
    assert entry.count("S(5)") == 2 * len(offloaded)
    # the same step lowered for GPU moves them by memory space: in before use, out after
    exported = jax.export.export(zstep.step, platforms=("cuda",))(
        zstep.abstract_state, jax.ShapeDtypeStruct(batch.shape, batch.dtype,
                                                    sharding=zstep.batch_sharding))
    places = re.findall(r'_xla_buffer_placement = "(\w+)"', exported.mlir_module())
    # what the device computes with is moved in: the moments (update on the device) or, with
    # the update on the host, the params' shards (per layer, in the schedule)
    used = offloaded if mode == "optimizer" else jax.tree.leaves(zstep.abstract_state.params)
    assert places.count("device") >= len(used)
    assert places.count("pinned_host") >= len(offloaded)
    if mode == "both":  # the update itself is outlined to the host
        assert '_xla_compute_type = "host"' in exported.mlir_module()


@pytest.mark.parametrize(("stage", "save_mode", "load_mode"),
                         [(3, "both", None), (3, None, "optimizer"), (2, None, "both")])
def test_checkpoint_restores_across_offload_modes(tmp_path, stage, save_mode, load_mode):
    saver = _step(stage, **MODES.get(save_mode, {}))
    state = _train(saver, 2)
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig())
    ckpt.save(2, state, saver, meta={"step": 2})
    ckpt.wait()
    loader = _step(stage, **MODES.get(load_mode, {}))
    restored = ckpt.restore(2, loader)[0]
    ckpt.close()
    for got, want in [(restored.params, state.params), (restored.opt_state, state.opt_state)]:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want_kind = {"pinned_host"} if load_mode else {"device"}
    assert _opt_kinds(restored.opt_state) == want_kind
    restored, _ = loader.step(restored, loader.put_batch(token_batches(1)[0]))  # trains on
    assert np.isfinite(float(jax.tree.leaves(restored.params)[0].sum()))


def test_offload_param_without_a_separate_master_is_refused():
    with pytest.raises(zjax.ConfigError, match=r"zero\.offload_param\.device: host at stage 2"):
        zjax.make_step(gpt_trainable(), TX, mesh=zjax.make_mesh(),
                       zero=ZeroConfig(stage=2, gather_dtype="float32", offload_param=PARAM))


def test_train_with_offload_reports_bytes_and_exports(tmp_path):
    cfg = zjax.load_config(None, ["model.n_layers=2", "data.seq_len=32", "train.steps=2",
                                  "train.log_every=2", "train.eval_every=0",
                                  "logging.tensorboard=false",
                                  "zero.offload_optimizer.device=host",
                                  "zero.offload_param.device=host"])
    result = zjax.train("lm", cfg, run_dir=tmp_path / "run")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # the reported bytes are those of the arrays the run holds: device 0's shards, by memory
    held = {"device": 0, "pinned_host": 0}
    for x in jax.tree.leaves(result.state):
        held[x.sharding.memory_kind] += x.addressable_shards[0].data.nbytes
    assert held["pinned_host"] > 0
    assert (row["state_device_bytes"], row["state_host_bytes"]) == (held["device"],
                                                                    held["pinned_host"])
    # predicted (the ZeRO paper's formula) beside the compiled model states
    assert 0 < row["model_state_bytes"] <= row["predicted_model_state_bytes"]
    # the gathered export reads the host-resident master like any other checkpoint
    out = export(tmp_path / "run", tmp_path / "export", dtype="float32")
    exported = ocp.StandardCheckpointer().restore(out)
    assert _kinds(result.state.params) == {"pinned_host"}
    for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(result.state.params),
                         strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))
