"""ZeRO-R's activation settings at stages 0-2, where params are whole: ``kept_scan`` equals a
checkpointed ``lax.scan``, training with saved inputs in host memory or split over ``model``
equals training without (NNX ``Stack`` models and ``from_pytree`` scans), and the compiled
step's host bytes are exactly the saved inputs'.

Tolerances: ``GRADS`` (helpers) for the unit test (the same float32 ops, reordered by the
custom backward); training runs are compared at rtol 1e-6 (the same ops at every step).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from any_models import MODELS, TX
from helpers import GRADS, assert_trees_close, train_steps
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import TINY_LLAMA, llama_trainable, token_batches

import zjax
from zjax.partition import ZeroConfig, kept_scan
from zjax.runtime.targets import target


def _layer(p, h, ctx):
    seg, scale = ctx
    mixed = jnp.where((seg[:, :, None] == seg[:, None, :]), 1.0, 0.0) @ h / h.shape[1]
    return h + jnp.tanh((h + mixed) @ p["w"] + p["b"]) * scale


def _inputs(d=8, n_layers=3):
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (n_layers, d, d)) / d ** 0.5,
              "b": jax.random.normal(k[1], (n_layers, d))}
    h = jax.random.normal(k[2], (2, 6, d))
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    return params, h, (seg, jnp.float32(0.7))


def _reference(params, h, ctx):
    body = jax.checkpoint(lambda h, p: (_layer(p, h, ctx), None))
    return lax.scan(body, h, params)[0]


@pytest.mark.parametrize("keep", ["offload", "partition"])
def test_kept_scan_equals_a_checkpointed_scan_in_values_and_gradients(keep):
    """Gradients of params, input and the float context entry (the integer segment ids
    have none); ``partition`` splits the kept inputs over a 2-way ``model`` axis."""
    params, h, ctx = _inputs()

    def loss(run, params, h, scale):
        return jnp.sum(run(params, h, (ctx[0], scale)) ** 2)

    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    kw = dict(offload=True) if keep == "offload" else dict(partition_axis="model")
    kept = lambda p, x, c: kept_scan(_layer, p, x, context=c, **kw)

    def grads(run):
        fn = jax.shard_map(jax.value_and_grad(lambda *a: loss(run, *a), argnums=(0, 1, 2)),
                           mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        return jax.jit(fn)(params, h, ctx[1])

    assert_trees_close(grads(kept), grads(_reference), **GRADS, what=keep)


def _llama_run(stage: int, mesh_model: int = 1, **zero):
    mesh = zjax.make_mesh(zjax.MeshConfig(data=8 // mesh_model, model=mesh_model))
    cfg = dataclasses.replace(TINY_LLAMA, n_layers=3)
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0, **zero)
    _, state, losses = train_steps(llama_trainable(cfg), zero, token_batches(3), mesh=mesh)
    return state.params, losses


@pytest.mark.parametrize("stage,keep", [
    pytest.param(0, "offload_activations", marks=pytest.mark.slow),
    (2, "offload_activations"),
    pytest.param(1, "partition_activations", marks=pytest.mark.slow)])
def test_training_a_stack_with_kept_inputs_equals_training_without(stage, keep):
    model = 2 if keep == "partition_activations" else 1
    params, losses = _llama_run(stage, model, **{keep: True})
    ref_params, ref_losses = _llama_run(stage, model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_trees_close(params, ref_params, rtol=1e-6, atol=1e-7, what=keep)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_stacks_kept_inputs_go_to_the_host_in_the_lowered_step(stage):
    """Lowered for ``h100:8`` (XLA:CPU has one memory), not compiled."""
    h100 = zjax.make_mesh(devices=target("h100:8").devices)
    spec = jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=NamedSharding(h100, P("data")))
    for offload in (False, True):
        zero = ZeroConfig(stage=stage, offload_activations=offload)
        zstep = zjax.make_step(llama_trainable(), TX, zero=zero, mesh=h100)
        assert ("pinned_host" in zstep.lower(spec).as_text()) == offload


def _pytree_step(name: str, mesh=None, **zero):
    init, loss = MODELS[name](n_layers=3, d=32, f=128)
    return zjax.make_step(zjax.from_pytree(init, loss), TX, mesh=mesh or zjax.make_mesh(),
                          zero=ZeroConfig(stage=2, **zero))


@pytest.mark.parametrize("name", ["jax_scan", pytest.param("eqx_scan", marks=pytest.mark.slow)])
def test_a_pytree_models_scan_keeps_its_inputs_on_the_host_at_stage_2(name):
    """The same losses and gradient norms; lowered for ``h100:8`` (XLA:CPU has one memory)
    the kept step moves values to ``pinned_host``, the plain one nothing."""
    runs = []
    h100 = zjax.make_mesh(devices=target("h100:8").devices)
    for offload in (False, True):
        spec = jax.ShapeDtypeStruct((16, 9), jnp.int32, sharding=NamedSharding(h100, P("data")))
        lowered = _pytree_step(name, h100, offload_activations=offload).lower(spec)
        assert ("pinned_host" in lowered.as_text()) == offload
        zstep = _pytree_step(name, offload_activations=offload)
        state, out = zstep.init(jax.random.key(0)), []
        for b in token_batches(3, batch=16, seq=8):
            state, m = zstep.step(state, zstep.put_batch(b))
            out.append((float(m["loss"]), float(m["grad_norm"])))
        runs.append(out)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)


@pytest.mark.slow  # an H100 compile
def test_stage_2s_host_bytes_are_the_saved_inputs_on_h100():
    """4 layers x [1, 2048, 512] bfloat16 per device, as at stage 3; less device temp."""
    sizes = ["model.n_layers=4", "data.seq_len=2048", "model.max_seq_len=2048",
             "data.batch_size=8", "model.d_model=512", "model.d_ff=1024",
             "model.attention=blockwise", "zero.stage=2"]
    reports = [zjax.plan(zjax.load_config("configs/llama-tiny.yaml",
                                          [*sizes, f"zero.offload_activations={off}"]),
                         target="h100:8") for off in ("false", "true")]
    plain, kept = (r.per_device for r in reports)
    assert kept["host_temp_bytes"] == 4 * 1 * 2048 * 512 * 2 == reports[1].activations[
        "host_bytes"]
    assert not plain.get("host_temp_bytes")
    assert kept["temp_bytes"] < plain["temp_bytes"]
