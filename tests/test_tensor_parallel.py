"""Hybrid parallelism: ZeRO over ``data`` x Megatron tensor parallelism over ``model``."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import numpy as np
import optax
import pytest
from helpers import (
    FP32,
    ROOT,
    adam_moments,
    assert_matches_reference,
    assert_trees_close,
    compile_on,
    make_tx,
    reference_run,
    zjax_main,
)
from models import gpt_reference_loss, gpt_trainable, token_batches

import zjax
from zjax.checkpoint import CheckpointConfig, Checkpointer, to_canonical
from zjax.config import load_config
from zjax.export import export
from zjax.models import GPTConfig
from zjax.planning import axes_of as _axes_of
from zjax.planning import collective_bytes, compile_report
from zjax.planning import report as plan_report
from zjax.planning import search as _autotune

pytestmark = pytest.mark.slow  # compiles or trains at length: outside the fast loop

# 4 heads (model = 1, 2, 4 all divide them); d_ff 96 so that no TP slice of one weight has
# the shape of another whole weight (the HLO test tells them apart by shape)
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, d_ff=96, max_seq_len=16)
MESHES = [(8, 1), (4, 2), (2, 4)]


def _zstep(data: int, model: int, *, prefetch: int = 1, stage: int = 3, cfg=CFG, devices=None):
    zero = zjax.ZeroConfig(stage=stage, prefetch_layers=prefetch, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")
    mesh = zjax.make_mesh(zjax.MeshConfig(data=data, model=model), devices=devices)
    return zjax.make_step(gpt_trainable(cfg), make_tx(), zero=zero, mesh=mesh)


def _run(zstep, batches):
    """``(state, losses)`` of ``zstep`` from its init over ``batches``."""
    state = zstep.init(jax.random.key(0))
    losses = []
    for b in batches:
        state, metrics = zstep.step(state, zstep.put_batch(b))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def reference():
    batches = token_batches(5)
    return batches, reference_run(gpt_trainable(CFG).init, gpt_reference_loss(CFG), make_tx(),
                                  batches)


@pytest.mark.parametrize(("data", "model", "stage"), [(d, m, 3) for d, m in MESHES]
                         + [(4, 2, 1)])
def test_2d_meshes_match_single_device(reference, data, model, stage):
    """5 steps on each mesh equal single-device optax within fp32 tolerance (FP32)."""
    batches, expected = reference
    zstep = _zstep(data, model, stage=stage)
    state, losses = _run(zstep, batches)
    assert_matches_reference(losses, state, expected)
    # every leaf's stored shard is 1/data of it (stage 3; the optimizer state's at stage 1),
    # and 1/model more where the rules split it
    stored = state.params if stage == 3 else adam_moments(state.opt_state)[0]
    for leaf, x in zip(zstep.plan.leaves, jax.tree.leaves(stored), strict=True):
        shard = x.addressable_shards[0].data.shape
        expected = list(leaf.shape)
        expected[leaf.dim] //= data
        if leaf.model_dim is not None:
            expected[leaf.model_dim] //= model
        assert shard == tuple(expected), leaf.path


def test_gpt2_layout_on_a_2d_mesh_matches_single_device():
    """GPT-2's options (LayerNorm, biases): the column-parallel biases split over model with
    their heads / hidden units, the row-parallel ones added once after the sum."""
    cfg = dataclasses.replace(CFG, norm="layer", bias=True, norm_eps=1e-5)
    batches = token_batches(5)
    expected = reference_run(gpt_trainable(cfg).init, gpt_reference_loss(cfg), make_tx(),
                             batches)
    zstep = _zstep(4, 2, cfg=cfg)
    names = {leaf.path.split("/")[-1]: leaf for leaf in zstep.plan.leaves}
    assert {k: names[k].model_dim for k in ("bq", "bk", "bv", "b_up", "bo", "b_down")} == {
        "bq": 1, "bk": 1, "bv": 1, "b_up": 1, "bo": None, "b_down": None}
    state, losses = _run(zstep, batches)
    assert_matches_reference(losses, state, expected)


def test_bf16_working_copy_on_a_2d_mesh(reference):
    """Stage 1 with bf16 gathers: a float32 master split both ways, the bf16 working copy
    all-gathered over data only (still split over model); losses within 1% of float32."""
    batches, (_, _, ref_losses) = reference
    zero = zjax.ZeroConfig(stage=1, gather_dtype="bfloat16", param_persistence_threshold=0)
    zstep = zjax.make_step(gpt_trainable(CFG), make_tx(), zero=zero,
                           mesh=zjax.make_mesh(zjax.MeshConfig(data=4, model=2)))
    assert zstep.plan.has_master
    state = zstep.init(jax.random.key(0))
    losses = []
    for b in batches:
        state, metrics = zstep.step(state, zstep.put_batch(b))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=0.01)
    w_up = state.params["blocks"]["layers"]["w_up"]
    assert w_up.dtype == jax.numpy.bfloat16
    assert w_up.addressable_shards[0].data.shape == (3, 32, 48)  # whole over data, 1/2 model


def test_plan_splits_heads_and_mlp_over_model_and_shards_data_elsewhere():
    plan = _zstep(4, 2).plan
    by = plan.leaves_by_path
    # Megatron layout: QKV / up column-parallel, output / down row-parallel (dim 0 stacks layers)
    for name, mdim in [("wq", 2), ("wk", 2), ("wv", 2), ("w_up", 2), ("wo", 1), ("w_down", 1)]:
        leaf = by[f"blocks/layers/{name}"]
        assert leaf.model_dim == mdim and leaf.dim not in (None, 0, mdim), name
        assert str(leaf.spec) == str(jax.P(None, *(
            "data" if d == leaf.dim else "model" for d in (1, 2))))
    for name in ("embed", "pos", "ln_f/scale", "blocks/layers/ln1/scale"):
        assert by[name].model_dim is None, name


def test_4x2_bytes_and_collectives_by_axis():
    """Split leaves take total/8 per device; ZeRO moves 1/model of them over data, and tensor
    parallelism all-reduces only activations over model."""
    zstep = _zstep(4, 2, prefetch=0)
    plan = zstep.plan
    compiled = compile_on(zstep.lower(jax.ShapeDtypeStruct((16, 17), np.int32)))
    a = zstep.abstract_state
    for leaf, x in zip(plan.leaves, jax.tree.leaves(a.params), strict=True):
        per_device = np.prod(x.sharding.shard_shape(x.shape)) * 4
        split = 8 if leaf.model_dim is not None else 4
        assert per_device * split == leaf.size * 4, leaf.path
    text = compiled.as_text()
    coll = collective_bytes(text, mesh_axes=dict(plan.mesh.shape))
    # each sharded leaf's gradient is reduce-scattered once over data, 1/model of it
    slice_bytes = sum(leaf.size // (2 if leaf.model_dim is not None else 1) * 4
                      for leaf in plan.leaves if leaf.dim is not None)
    assert coll.by_axis["data"]["reduce_scatter"] == slice_bytes
    assert set(coll.by_axis["model"]) == {"all_reduce"}  # no weight ever moves over model
    assert set(coll.by_axis) == {"data", "model"}  # each collective runs over one axis
    # per layer group: the gathered weights are the TP slices, never whole weights
    gathered = {m.group(1) for m in re.finditer(r"u32\[([\d,]+)\][^\n]* all-gather\(", text)}
    assert {"32,48", "48,32", "32,16", "16,32"} <= gathered  # w_up, w_down, wq/k/v, wo
    assert not gathered & {"32,96", "96,32", "32,32"}
    # model-axis all-reduces are activations [B/data, T, d_model]: 2 per layer forward, 1 in
    # the recomputed forward (attention output), 2 in backward (QKV and MLP inputs)
    mesh_axes = dict(plan.mesh.shape)
    ar = [line for line in text.splitlines() if re.search(r" all-reduce\(", line)
          and _axes_of(line, mesh_axes) == "model"]
    activations = [line for line in ar if "f32[4,16,32]" in line]
    # the norms' partial sums (f32) and the finiteness checks (pred): scalars only
    scalars = [line for line in ar if set(re.findall(r"\w+\[[\d,]*\]", line.split(
        " all-reduce(")[0].split("=", 1)[1])) <= {"f32[]", "pred[]"}]
    assert activations and len(activations) + len(scalars) == len(ar)
    extra = coll.by_axis["model"]["all_reduce"] - 5 * CFG.n_layers * 4 * 16 * 32 * 4
    assert 0 <= extra < 1024
    # the plan reports the same split
    report = plan_report(zstep, compiled)
    assert report.collectives_by_axis == coll.by_axis
    assert report.setting["mesh"] == {"data": 4, "model": 2} and report.n_devices == 8


def test_bad_meshes_are_config_errors():
    with pytest.raises(zjax.ConfigError, match=r"mesh: data=3 x model=2 = 6 does not equal the 8"):
        zjax.make_mesh(zjax.MeshConfig(data=3, model=2))
    with pytest.raises(zjax.ConfigError, match=r"mesh.model: 3 does not divide the 8 devices"):
        zjax.make_mesh(zjax.MeshConfig(model=3))
    odd_ff = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=36, max_seq_len=16)
    with pytest.raises(zjax.ConfigError,
                       match=r"^mesh: the model axis \(8\) does not divide the 'mlp' dimension of "
                             r"blocks/layers/w_(up|down) \(size 36"):
        _zstep(1, 8, cfg=odd_ff)
    zstep = _zstep(1, 8, cfg=GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                       max_seq_len=16))
    with pytest.raises(zjax.ConfigError,
                       match=r"^mesh: the model axis \(8\) does not divide the 4 attention"):
        zstep.lower(jax.ShapeDtypeStruct((16, 17), np.int32))
    # a model that names no dimension for tensor parallelism cannot use a model axis
    plain = zjax.from_pytree(lambda rng: {"w": jax.random.normal(rng, (8, 8))},
                             lambda p, b: (jax.numpy.sum(p["w"]) * 0, 1.0))
    with pytest.raises(zjax.ConfigError, match=r"^mesh: a model axis of 2, but the model names no"):
        zjax.make_step(plain, make_tx(), zero=zjax.ZeroConfig(stage=3),
                       mesh=zjax.make_mesh(zjax.MeshConfig(model=2)))


def _canonical(state, zstep):
    return jax.tree.map(np.asarray, to_canonical(state, zstep))


def _restored(zstep, run):
    ckpt = Checkpointer(run / "checkpoints", CheckpointConfig())
    step, state, _, _ = ckpt.restore_latest(zstep)
    ckpt.close()
    return step, state


def _save(run, step, state, zstep):
    ckpt = Checkpointer(run / "checkpoints", CheckpointConfig())
    ckpt.save(step, state, zstep)
    ckpt.close()  # written before the next step donates the state


def test_checkpoints_move_between_mesh_shapes_bitwise(reference, tmp_path):
    """8x1 -> 4x2 -> 2x4 -> 1 device: each hop restores the previous mesh's checkpoint
    bitwise, saves it from its own shards and trains on; the export is the same throughout."""
    batches, _ = reference
    zstep = _zstep(8, 1)
    state = zstep.init(jax.random.key(0))
    for b in batches[:3]:
        state, _ = zstep.step(state, zstep.put_batch(b))
    expected = _canonical(state, zstep)
    runs = [tmp_path / "run8x1"]
    _save(runs[0], 3, state, zstep)
    _, metrics = zstep.step(state, zstep.put_batch(batches[3]))
    next_losses = [float(metrics["loss"])]
    for data, model, devices in [(4, 2, None), (2, 4, None), (1, 1, jax.devices()[:1])]:
        zstep = _zstep(data, model, devices=devices)
        step, state = _restored(zstep, runs[-1])
        assert step == 3
        for x, y in zip(jax.tree.leaves(_canonical(state, zstep)), jax.tree.leaves(expected),
                        strict=True):
            np.testing.assert_array_equal(x, y)
        runs.append(tmp_path / f"run{data}x{model}")
        _save(runs[-1], step, state, zstep)
        _, metrics = zstep.step(state, zstep.put_batch(batches[3]))
        next_losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(next_losses, next_losses[0], rtol=1e-6)
    exports = [export(run, tmp_path / f"{run.name}.safetensors", dtype="float32",
                           format="safetensors").read_bytes() for run in runs]
    assert all(e == exports[0] for e in exports[1:])


def _plan_cli(*args):
    return zjax_main("plan", "configs/tiny.yaml", "model.n_layers=2", "data.seq_len=32", *args)


def test_plan_cli_on_a_2d_mesh():
    r = _plan_cli("mesh.data=4", "mesh.model=2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["setting"]["mesh"] == {"data": 4, "model": 2} and report["n_devices"] == 8
    by_axis = report["collectives_by_axis"]
    assert by_axis["data"]["all_gather"] > 0 and by_axis["data"]["reduce_scatter"] > 0
    assert set(by_axis["model"]) == {"all_reduce"}
    # tiny.yaml's 4 heads cannot be split 8 ways: exit 2, the key and sizes, no traceback
    r = _plan_cli("mesh.model=8")
    assert r.returncode == 2 and ("mesh.model: the model axis (8) does not divide the 4 "
                                  "attention heads") in r.stderr
    assert "Traceback" not in r.stderr


def test_budget_search_picks_a_model_axis_when_only_it_fits():
    """Stage 0 alone: splitting the weights over model is what makes a tight budget fit."""
    config = load_config(ROOT / "configs/tiny.yaml", ["model.n_layers=2", "data.seq_len=32"])
    space = dict(stages=(0,), offloads=("none",), grad_accum=(1,), remat=(True,), model=(1, 2))
    tune = functools.partial(_autotune, config, compile_report=lambda c: compile_report(
        c, jax.devices()), n_devices=8, **space)
    rows = {c.model: r for c, r in tune(budget_bytes=2**40).rows}
    totals = {m: r.per_device["total_bytes"] for m, r in rows.items()}
    assert totals[2] < totals[1]  # params, master and moments of the split leaves halve
    assert rows[2].per_device["model_state_bytes"] < rows[1].per_device["model_state_bytes"]
    result = tune(budget_bytes=(totals[1] + totals[2]) // 2)
    assert result.config.mesh.model == 2 and result.config.mesh.data == -1
    assert "model" in result.table().splitlines()[1]


@pytest.mark.parametrize(("groups", "axes", "size"), [
    ("{{0,2,4,6},{1,3,5,7}}", "data", 4),
    ("[4,2]<=[8]", "model", 2),
    ("[2,4]<=[4,2]T(1,0)", "data", 4),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}", "data", 4),
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2] {'axis_2'}", "model", 2),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_2'}", "data", 4),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", "data+model", 8),
    ("{}", "data+model", 1),  # all devices
])
def test_replica_group_spellings_map_to_mesh_axes(groups, axes, size):
    """XLA writes replica groups three ways; each is attributed to the axes it spans on 4x2."""
    from zjax.planning import axes_of as _axes_of
    from zjax.planning import group_size as _group_size

    line = f"%x = f32[8] all-reduce(%y), channel_id=1, replica_groups={groups}, to_apply=%r"
    assert _axes_of(line, {"data": 4, "model": 2}) == axes
    assert _group_size(line) == size


def test_trainer_runs_and_evaluates_on_a_2d_mesh(tmp_path):
    cfg = load_config(ROOT / "configs/tiny-tp.yaml",
                      ["model.n_layers=2", "data.seq_len=32", "train.steps=2",
                       "train.log_every=1", "train.eval_every=2", "logging.tensorboard=false"])
    history = zjax.train(None, cfg, run_dir=tmp_path / "run").history
    assert [row["step"] for row in history] == [1, 2]
    assert all(np.isfinite(row["loss"]) for row in history)
    assert np.isfinite(history[-1]["eval_loss"])


def test_offload_on_a_2d_mesh_matches_no_offload(reference):
    """Both offloads (update on the host) at 4x2 give the same params as no offload."""
    from zjax.offload import OffloadConfig, OptimizerOffloadConfig
    from zjax.step.optim import clip_by_global_norm

    batches, _ = reference
    host = dict(offload_optimizer=OptimizerOffloadConfig(device="host", update_on="host"),
                offload_param=OffloadConfig(device="host"))
    params = []
    for offload in ({}, host):
        zero = zjax.ZeroConfig(stage=3, gather_dtype="float32", param_persistence_threshold=0,
                               **offload)
        tx = optax.chain(clip_by_global_norm(0.5), optax.adamw(3e-3, eps=1e-5))  # host-safe
        zstep = zjax.make_step(gpt_trainable(CFG), tx, zero=zero,
                               mesh=zjax.make_mesh(zjax.MeshConfig(data=4, model=2)))
        state = zstep.init(jax.random.key(0))
        for b in batches[:2]:
            state, _ = zstep.step(state, zstep.put_batch(b))
        assert jax.tree.leaves(state.params)[0].sharding.memory_kind == \
            ("pinned_host" if offload else "device")
        params.append(jax.tree.map(np.asarray, state.params))
    assert_trees_close(params[1], params[0], **FP32, what="params")
