"""ZeRO++'s hierarchical partition (hpZ, ``zero.hpz_partition_size``): params sharded over all
devices as ``(data, node)``, the forward gathering across nodes then within, the backward
re-gathering within the node from the secondary partition the forward kept, gradients
reduce-scattered within the node then across. Equality with single-device optax, the
secondary partition's bytes in the compiled step's memory, and inter-host bytes read from the
compiled HLO on 2 simulated hosts x 4 devices."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import (
    ROOT,
    adam_moments,
    assert_matches_reference,
    latest_checkpoint,
    make_tx,
    train_steps,
)
from models import gpt_trainable

import zjax
from zjax.config import load_config
from zjax.planning import compile_report

pytestmark = pytest.mark.slow


def _zero(**kw) -> zjax.ZeroConfig:
    base = dict(stage=3, prefetch_layers=1, param_persistence_threshold=0,
                gather_dtype="float32", reduce_dtype="float32", hpz_partition_size=4)
    return zjax.ZeroConfig(**{**base, **kw})


@pytest.mark.parametrize(("k", "prefetch", "model", "micro"), [
    (4, 1, 1, 1), (2, 0, 1, 2), (2, 1, 2, 1), (4, 2, 1, 1)])
def test_hpz_matches_single_device(gpt_reference, k, prefetch, model, micro):
    """fp32 gathers: hpZ is the same arithmetic as stage 3, only the collectives differ."""
    batches, expected = gpt_reference
    mesh = zjax.make_mesh(zjax.MeshConfig(model=model))
    zstep, state, losses = train_steps(
        gpt_trainable(), _zero(hpz_partition_size=k, prefetch_layers=prefetch), batches,
        mesh=mesh, micro_batches=micro)
    assert_matches_reference(losses, state, expected)
    plan = zstep.plan
    assert (plan.n_node, plan.n_data, plan.n_shard) == (8 // model // k, k, 8 // model)
    # every sharded leaf is split over all 8 / model devices, not over a node's k
    for leaf, x in zip(plan.leaves, jax.tree.leaves(state.params), strict=True):
        if leaf.dim is not None:
            assert x.addressable_shards[0].data.shape[leaf.dim] == \
                leaf.shape[leaf.dim] // plan.n_shard
    # so is the optimizer state: 8 / model distinct slices of each moment
    mu, _ = adam_moments(state.opt_state)
    j = next(j for j, leaf in enumerate(plan.leaves) if leaf.dim is not None)
    slices = {str(s.index) for s in jax.tree.leaves(mu)[j].addressable_shards}
    assert len(slices) == plan.n_shard * (model if plan.leaves[j].model_dim is not None else 1)


# the two compiled-step tests' model: wide enough that the secondary partition is the temp
# it adds (tiny.yaml's 4 layers of 128 grow by 1.25 times it); the inter-host bytes hold at
# any size
WIDER = ("model.d_model=512", "model.n_layers=8", "model.n_heads=8")


def _report(*overrides):
    """The plan of tiny.yaml at ``WIDER`` with ``overrides`` on 2 hosts (each configuration
    compiled once for both tests: seconds each)."""
    return _compiled_report(tuple(sorted(overrides)))  # distinct keys: order is immaterial


@functools.cache
def _compiled_report(overrides):
    config = load_config(ROOT / "configs/tiny.yaml",
                         ["zero.stage=3", "zero.reduce_dtype=float32", *WIDER, *overrides])
    return compile_report(config, jax.devices(), hosts=2)


def _inter(report, kind):
    return report.collectives_by_link.get("inter_host", {}).get(kind, 0)


def test_hpz_keeps_backward_gathers_and_half_the_scatter_in_the_node():
    """On 2 hosts x 4 devices (``WIDER``, bf16 gathers, prefetch 1): stage 3's gathers and
    scatters all span both hosts. With hpZ over 4, a stacked weight crosses hosts once, in
    the forward's gather across nodes (a quarter of it per device), and the backward gathers
    within the host only; the leaves outside the stack cross in both passes. The gradients'
    second level (a quarter, and a wasted layer of zeros) leaves the host. qwZ halves the
    inter-host gathers again, qgZ cuts the gradients' by about int8 / float32."""
    plain, hpz = _report(), _report("zero.hpz_partition_size=4")
    qwz = _report("zero.hpz_partition_size=4", "zero.quantized_weights=true")
    qgz = _report("zero.hpz_partition_size=4", "zero.quantized_weights=true",
                  "zero.quantized_gradients=true")
    plan = zjax.build_step(load_config(ROOT / "configs/tiny.yaml", WIDER)).plan
    stack = [leaf for leaf in plan.leaves if leaf.stacked and leaf.dim is not None]
    layers = stack[0].shape[0]
    outside = sum(leaf.size for leaf in plan.leaves if not leaf.stacked and leaf.dim is not None)
    # bf16 slices of 1/4: the stack once (and the forward's one prefetch past its end)
    crossing = 2 * sum(leaf.size for leaf in stack) / 4 * (layers + 1) / layers \
        + 2 * 2 * outside / 4
    assert 0.9 * crossing < _inter(hpz, "all_gather") <= crossing
    assert _inter(hpz, "all_gather") < _inter(plain, "all_gather") / 6
    assert _inter(qwz, "all_gather") < _inter(hpz, "all_gather") * 0.6
    # gradients leave the host as a reduce-scatter (direct) or an all-to-all (qgZ)
    hpz_grads = _inter(hpz, "reduce_scatter")
    qgz_grads = _inter(qgz, "reduce_scatter") + _inter(qgz, "all_to_all")
    # a quarter, one layer more: the first backward iteration sends zeros across nodes (the
    # price of issuing each layer's second level during the next layer's compute)
    stack_bytes = 4 * sum(leaf.size for leaf in stack)
    outside_bytes = 4 * outside
    assert hpz_grads == pytest.approx(
        (stack_bytes * (layers + 1) / layers + outside_bytes) / 4, rel=0.01)
    assert _inter(plain, "reduce_scatter") == pytest.approx(stack_bytes + outside_bytes,
                                                            rel=0.01)
    assert qgz_grads < hpz_grads * 0.3
    # within the host: the backward's re-gathers and the first level of the scatter
    assert hpz.collectives_by_link["intra_host"]["all_gather"] > 0
    assert hpz.setting["mesh"] == {"data": 4, "model": 1, "node": 2}


def test_secondary_partition_memory_is_in_the_compiled_step():
    """The forward keeps each stacked weight's secondary partition for the backward: the
    compiled step's temp grows by 2 Psi_stack / k bytes (bf16; d_model 512, 8 layers), as
    the plan reports; with qwZ the partition is kept as int8 and about halves."""
    base, hpz = _report(), _report("zero.hpz_partition_size=4")
    assert "hpz_secondary_bytes" not in base.formula
    config = load_config(ROOT / "configs/tiny.yaml", WIDER)
    stack = sum(leaf.size for leaf in zjax.build_step(config).plan.leaves
                if leaf.stacked and leaf.dim is not None)
    assert hpz.formula["hpz_secondary_bytes"] == 2 * stack // 4
    grew = hpz.per_device["temp_bytes"] - base.per_device["temp_bytes"]
    assert grew == pytest.approx(2 * stack / 4, rel=0.02)
    quantized = ["zero.quantized_weights=true"]
    grew_q = _report(*quantized, "zero.hpz_partition_size=4").per_device["temp_bytes"] \
        - _report(*quantized).per_device["temp_bytes"]
    assert grew_q == pytest.approx(stack / 4, rel=0.1)  # 1 byte + a scale per 256


def test_hpz_is_refused_where_it_cannot_work():
    with pytest.raises(zjax.ConfigError, match=r"zero.hpz_partition_size: 4 partitions "
                                               r"stage 3's gathered weights, but zero.stage"):
        zjax.ZeroConfig(stage=2, hpz_partition_size=4)
    with pytest.raises(zjax.ConfigError, match=r"zero.hpz_partition_size: 3 does not divide "
                                               r"the data axis \(8 devices\)"):
        zjax.make_step(gpt_trainable(), make_tx(), zero=_zero(hpz_partition_size=3),
                       mesh=zjax.make_mesh())
    with pytest.raises(zjax.ConfigError, match=r"with mesh.replica: 2"):
        zjax.make_step(gpt_trainable(), make_tx(), zero=_zero(hpz_partition_size=2),
                       mesh=zjax.make_mesh(zjax.MeshConfig(replica=2)))


def test_batch_slices_follow_node_and_data():
    """The batch is split over (node, data) in the devices' order: the same slices as
    stage 3 on the unsplit mesh, so a loader's shards do not move."""
    zstep = zjax.make_step(gpt_trainable(), make_tx(), zero=_zero(), mesh=zjax.make_mesh())
    batch = np.arange(16 * 17, dtype=np.int32).reshape(16, 17)
    put = zstep.put_batch(batch)
    for shard in put.addressable_shards:
        i = list(jax.devices()).index(shard.device)
        np.testing.assert_array_equal(shard.data, batch[2 * i:2 * i + 2])


@pytest.mark.parametrize(("name", "offload"), [("jax_loop", False), ("eqx_scan", False),
                                               ("eqx_scan", True)])
def test_hpz_for_models_zjax_does_not_own(name, offload):
    """The gather-on-use transform's unrolled segments and scheduled scans under hpZ (and
    with params and optimizer state in host memory): equal to single-device optax."""
    from any_models import train_and_compare, zero3_step

    from zjax.offload import OffloadConfig, OptimizerOffloadConfig

    extra = dict(offload_optimizer=OptimizerOffloadConfig(device="host"),
                 offload_param=OffloadConfig(device="host")) if offload else {}
    zstep, init, loss = zero3_step(name, hpz_partition_size=4, prefetch_layers=1, **extra)
    assert zstep.plan.n_node == 2
    train_and_compare(zstep, init, loss)


def test_checkpoints_move_between_hpz_and_plain_layouts(tmp_path):
    """An hpZ run's checkpoint (shards over node x data) restores bitwise as plain stage 3
    and on one device, and a plain run's restores under hpZ: the swap of layouts is Orbax's
    resharding, params and moments alike."""
    overrides = ["train.steps=2", "train.eval_every=0", "checkpoint.every=2",
                 "logging.progress=false"]
    hpz = ["zero.hpz_partition_size=4"]
    for name, layout in (("hpz", hpz), ("plain", [])):
        zjax.train(None, load_config(ROOT / "configs/tiny.yaml", [*overrides, *layout]),
                   run_dir=tmp_path / name)
    for run, other in (("hpz", []), ("plain", hpz)):
        step, written = latest_checkpoint(tmp_path / run, hpz if run == "hpz" else [])
        again = latest_checkpoint(tmp_path / run, other)
        assert again[0] == step == 2
        jax.tree.map(np.testing.assert_array_equal, again[1], written)
    single = latest_checkpoint(tmp_path / "hpz", ["mesh.data=1"], devices=jax.devices()[:1])
    jax.tree.map(np.testing.assert_array_equal, single[1],
                 latest_checkpoint(tmp_path / "hpz", hpz)[1])
