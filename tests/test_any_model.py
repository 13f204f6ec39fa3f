"""ZeRO-3 for models zjax does not own: the gather-on-use transform (zjax.partition.transform).

Each model of ``any_models`` (plain JAX, Flax Linen, Equinox; unrolled loops and scans over
stacked layers) trains at stage 3 exactly as single-device optax does, gathers every weight
exactly twice per step, and holds a bounded number of gathered layers whatever its depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from any_models import (
    MODELS,
    TX,
    compiled_step,
    jax_flat,
    psi_bytes,
    train_and_compare,
    zero3_step,
)
from helpers import FP32, assert_trees_close, reference_run
from jax.sharding import PartitionSpec as P

import zjax
from zjax.errors import GatherFallbackWarning
from zjax.offload import OffloadConfig, OptimizerOffloadConfig
from zjax.partition import ZeroConfig
from zjax.partition.gather import gather_tree
from zjax.partition.transform import layer_of
from zjax.planning import collective_bytes, unordered_collectives

SCANNED = {"jax_scan", "linen_scan", "eqx_scan"}


def _quick(names, keep) -> list:
    """``names`` as parameters, all but ``keep`` outside the quick loop (``-m "not slow"``)."""
    return [pytest.param(n, marks=() if n in keep else pytest.mark.slow) for n in names]


# the quick loop keeps one model per framework (jax, linen, equinox), all scanned
@pytest.mark.parametrize("name", _quick(sorted(MODELS), SCANNED))
def test_stage3_equals_single_device_optax(name):
    train_and_compare(*zero3_step(name, prefetch_layers=1))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "prefetch"), [("jax_loop", 0), ("linen_scan", 2)])
def test_stage3_equals_optax_at_other_prefetch_depths(name, prefetch):
    train_and_compare(*zero3_step(name, n_layers=4, prefetch_layers=prefetch))


@pytest.mark.slow
def test_with_gradient_accumulation_and_offload():
    """Micro-batches around unrolled segments; params and Adam state in host memory around a
    scheduled loop."""
    train_and_compare(*zero3_step("jax_loop", micro_batches=2))
    train_and_compare(*zero3_step("eqx_scan", offload_optimizer=OptimizerOffloadConfig(
        device="host"), offload_param=OffloadConfig(device="host")))


@pytest.mark.parametrize("name", _quick(sorted(MODELS), {"jax_scan", "linen_loop"}))
def test_every_weight_is_gathered_twice_and_reduced_once(name):
    """bf16 gathers, fp32 reduce; a scan at prefetch k gathers k layers more (the drain)."""
    n_layers, k = 4, 1
    zstep, init, _ = zero3_step(name, n_layers=n_layers, gather_dtype="bfloat16", prefetch_layers=k)
    text = compiled_step(zstep).as_text()
    coll = collective_bytes(text)
    psi = psi_bytes(init, 1)
    stacked = sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(init, jax.random.key(0)))[0] if _is_stacked(name, path))
    drain = k * stacked // n_layers if name in SCANNED else 0
    assert coll.all_gather == pytest.approx((2 * psi + drain) * 2, rel=0.02)
    assert coll.reduce_scatter == pytest.approx(psi * 4, rel=0.02)
    assert not unordered_collectives(text)  # XLA:CPU: no two collectives can collide


def _is_stacked(name, path) -> bool:
    keys = jax.tree_util.keystr(path, simple=True, separator="/")
    return name in SCANNED and ("stack" in keys or "blocks" in keys)


def test_a_model_without_layers_trains_whole_with_a_warning():
    init, loss = jax_flat()
    zstep = zjax.make_step(zjax.from_pytree(init, loss), TX, mesh=zjax.make_mesh(),
                           zero=ZeroConfig(stage=3, param_persistence_threshold=0,
                                           gather_dtype="float32"))
    with pytest.warns(GatherFallbackWarning, match="no layer structure"):
        train_and_compare(zstep, init, loss, n=3)


def test_a_program_the_transform_cannot_rewrite_falls_back_with_the_cause(monkeypatch):
    # only the analysis' own refusal falls back (tests/test_reliability_plan.py: a bug raises)
    from zjax.partition import transform
    from zjax.partition._program import CannotRewrite

    def refuses(*args, **kwargs):
        raise CannotRewrite("a primitive it does not know")

    monkeypatch.setattr(transform, "analyse", refuses)
    zstep, init, loss = zero3_step("jax_loop")
    with pytest.warns(GatherFallbackWarning, match="the loss holds a primitive it does not"):
        train_and_compare(zstep, init, loss, n=2)


def test_gather_tree_with_none_entries():
    """Equinox's filtered params have None entries; dims mark them None too."""
    params = {"w": jnp.ones((8, 4)), "act": None, "b": jnp.ones((4,))}
    dims = {"w": 0, "act": None, "b": None}

    def local(shards):
        return gather_tree(shards, dims)

    mesh = zjax.make_mesh()
    out = jax.shard_map(local, mesh=mesh, in_specs=({"w": P("data"), "act": None, "b": P()},),
                        out_specs={"w": P(), "act": None, "b": P()}, check_vma=False)(params)
    assert out["act"] is None and out["w"].shape == (8, 4)


@pytest.mark.parametrize(("path", "layer"), [
    ("transformer/h/3/attn/c_attn/kernel", "transformer/h/3"),
    ("layers_12/Dense_0/kernel", "12"),
    ("ln0/scale", "0"), ("up0/kernel", "0"),
    ("blocks/Dense_0/kernel", "blocks/0"),
    ("embed/embedding", "embed/embedding"),
])
def test_layers_are_named_by_the_first_numbered_path_component(path, layer):
    assert layer_of(path) == layer


def test_tensor_parallel_model_through_the_transform():
    """A from_pytree model written for tensor parallelism (Megatron's two operators, logical
    axes by path) on a data 4 x model 2 mesh: traced inside the step's shard_map, its psums over
    ``model`` are part of the rewritten program. Equals single-device optax."""
    from zjax.checkpoint import to_canonical
    from zjax.nn.tensor_parallel import column_parallel_input, row_parallel_output

    d, f = 32, 64

    def init(rng):
        keys = jax.random.split(rng, 3)
        return {"layers": [{"up": jax.random.normal(k, (d, f)) * 0.2,
                            "down": jax.random.normal(jax.random.fold_in(k, 1), (f, d)) * 0.2}
                           for k in keys]}

    def loss(params, x):
        h = x
        for layer in params["layers"]:
            y = jnp.tanh(column_parallel_input(h) @ layer["up"])
            h = h + row_parallel_output(y @ layer["down"])
        return jnp.sum(h ** 2), jnp.asarray(h.shape[0], jnp.float32)

    def axes(path):
        return ("embed", "mlp") if path.endswith("up") else ("mlp", "embed")

    zstep = zjax.make_step(zjax.from_pytree(init, loss, logical_axes=axes), TX,
                           mesh=zjax.make_mesh(zjax.MeshConfig(data=4, model=2)),
                           zero=ZeroConfig(stage=3, param_persistence_threshold=0,
                                           gather_dtype="float32"))
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(16, d)).astype(np.float32) for _ in range(4)]
    state = zstep.init(jax.random.key(0))
    for b in batches:
        state, _ = zstep.step(state, zstep.put_batch(b))
    ref_params, _, _ = reference_run(init, loss, TX, batches)
    params = jax.tree.map(np.asarray, to_canonical(state, zstep))["params"]
    assert_trees_close(params, ref_params, **FP32, what="params")
