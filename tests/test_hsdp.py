"""Hybrid sharding (``mesh.replica``, FSDP2's HSDP / DeepSpeed's MiCS): ZeRO shards over the
``data`` devices of each replica group, the batch over replica x data. Equality with
single-device optax at every stage (and with micro-batches and a model axis), shard shapes of
1/data, the gradient all-reduce over ``replica`` counted from the compiled HLO (the shards'
bytes, not the whole model's), and checkpoints moving between 2 x 4 and 8 devices."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from helpers import (
    ROOT,
    adam_moments,
    assert_matches_reference,
    compile_on,
    latest_checkpoint,
    make_tx,
    train_steps,
)
from models import gpt_trainable

import zjax
from zjax.config import load_config
from zjax.planning import collective_bytes

pytestmark = pytest.mark.slow


def _mesh(replica: int, data: int, model: int = 1):
    return zjax.make_mesh(zjax.MeshConfig(replica=replica, data=data, model=model))


def _zero(stage: int) -> zjax.ZeroConfig:
    return zjax.ZeroConfig(stage=stage, prefetch_layers=1, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")


@pytest.mark.parametrize(("stage", "replica", "data", "model", "micro"), [
    (3, 2, 4, 1, 1), (3, 4, 2, 1, 2), (2, 2, 4, 1, 1), (1, 2, 4, 1, 1), (3, 2, 2, 2, 1)])
def test_hybrid_sharding_matches_single_device(gpt_reference, stage, replica, data, model, micro):
    batches, expected = gpt_reference
    zstep, state, losses = train_steps(gpt_trainable(), _zero(stage), batches,
                                       mesh=_mesh(replica, data, model), micro_batches=micro)
    assert_matches_reference(losses, state, expected)
    assert zstep.plan.n_batch == replica * data
    stored = state.params if stage == 3 else adam_moments(state.opt_state)[0]
    for leaf, x in zip(zstep.plan.leaves, jax.tree.leaves(stored), strict=True):
        if leaf.dim is not None and leaf.model_dim is None:  # 1/data, whatever the replicas
            assert x.addressable_shards[0].data.shape[leaf.dim] == leaf.shape[leaf.dim] // data


def test_hybrid_sharding_with_offload_matches_single_device(gpt_reference):
    """Replica 2 x data 4 with the optimizer state and the params in host memory."""
    from zjax.offload import OffloadConfig, OptimizerOffloadConfig

    batches, expected = gpt_reference
    zero = dataclasses.replace(_zero(3), offload_optimizer=OptimizerOffloadConfig(device="host"),
                               offload_param=OffloadConfig(device="host"))
    _, state, losses = train_steps(gpt_trainable(), zero, batches, mesh=_mesh(2, 4))
    assert_matches_reference(losses, state, expected)


def test_replica_all_reduce_moves_the_shards_only():
    """Stage 3 on replica 2 x data 4: all-gathers stay within a group (over ``data``), and the
    only collective over ``replica`` is the gradients' all-reduce of 1/4 of the params."""
    mesh = _mesh(2, 4)
    zstep = zjax.make_step(gpt_trainable(), make_tx(), zero=_zero(3), mesh=mesh)
    batch = jax.ShapeDtypeStruct((16, 17), np.int32)
    coll = collective_bytes(compile_on(zstep.lower(batch)).as_text(), mesh_axes=dict(mesh.shape))
    sharded = sum(leaf.size for leaf in zstep.plan.leaves if leaf.dim is not None)
    replicated = sum(leaf.size for leaf in zstep.plan.leaves if leaf.dim is None)
    for axis, kinds in coll.by_axis.items():
        if "replica" in axis:  # no gather or scatter ever leaves a group
            assert not kinds.get("all_gather") and not kinds.get("reduce_scatter"), axis
    # the gradients: float32 shards of 1/4 of the sharded params (and the replicated leaves')
    assert coll.by_axis["replica"]["all_reduce"] == 4 * (sharded // 4 + replicated)
    # over the whole batch (replica x data): only the loss and count sums
    assert coll.by_axis.get("replica+data", {}).get("all_reduce", 0) <= 16


def test_inter_host_bytes_on_two_hosts():
    """On 2 hosts of 4 devices, stage 3 over data 8 crosses hosts with every gather and
    scatter; hybrid sharding (replica 2 x data 4) only with the gradients' 1/4 shards."""
    from zjax.planning import compile_report

    base = load_config(ROOT / "configs/tiny.yaml", ["zero.stage=3"])
    plain = compile_report(base, jax.devices(), hosts=2).collectives_by_link
    hybrid = compile_report(load_config(ROOT / "configs/tiny.yaml", [
        "zero.stage=3", "mesh.replica=2", "mesh.data=4"]), jax.devices(), hosts=2)
    inter = hybrid.collectives_by_link["inter_host"]
    assert set(inter) == {"all_reduce"}  # no gather or scatter between hosts
    assert inter["all_reduce"] == pytest.approx(
        hybrid.collectives_by_axis["replica"]["all_reduce"], abs=16)
    plain_inter = sum(plain["inter_host"].values())
    assert plain.get("intra_host", {}).get("all_gather", 0) == 0
    assert inter["all_reduce"] < plain_inter / 8
    assert "inter-host: all-reduce" in hybrid.table()


def test_link_of_reads_groups_against_hosts():
    from zjax.planning import link_of

    hosts = [0, 0, 1, 1]
    assert link_of("all-reduce(x), replica_groups={{0,1},{2,3}}", hosts) == "intra_host"
    assert link_of("all-reduce(x), replica_groups={{0,2},{1,3}}", hosts) == "inter_host"
    assert link_of("all-reduce(x), replica_groups={}", hosts) == "inter_host"  # every device


def test_checkpoint_moves_between_hybrid_and_plain_meshes(tmp_path):
    """A replica 2 x data 4 run's checkpoint restores bitwise on data 8, on replica 4 x
    data 2 and on one device (params and optimizer state)."""
    overrides = ["train.steps=2", "train.eval_every=0", "checkpoint.every=2",
                 "logging.progress=false"]
    config = load_config(ROOT / "configs/tiny.yaml",
                         [*overrides, "mesh.replica=2", "mesh.data=4"])
    zjax.train(None, config, run_dir=tmp_path / "run")
    step, hybrid = latest_checkpoint(tmp_path / "run", ["mesh.replica=2", "mesh.data=4"])
    for mesh in (["mesh.data=8"], ["mesh.replica=4", "mesh.data=2"]):
        other = latest_checkpoint(tmp_path / "run", mesh)
        assert other[0] == step == 2
        jax.tree.map(np.testing.assert_array_equal, other[1], hybrid)
    # and on a single device
    single = latest_checkpoint(tmp_path / "run", ["mesh.data=1"], devices=jax.devices()[:1])[1]
    jax.tree.map(np.testing.assert_array_equal, single, hybrid)
