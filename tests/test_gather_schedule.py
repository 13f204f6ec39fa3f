"""The gather primitive and the scheduled layer scan, tested directly inside shard_map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import GRADS, assert_trees_close
from jax.sharding import PartitionSpec as P

import zjax
from zjax.nn import Stack
from zjax.partition import REMAT_POLICY, Comm, ScheduleSpec, gather_tree, scheduled_scan
from zjax.planning import collective_bytes
from zjax.runtime._backend import backend

N = 8


def smap(f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=zjax.make_mesh(), in_specs=in_specs,
                                 out_specs=out_specs, axis_names={"data"}, check_vma=False),
                   compiler_options=dict(backend("cpu").compiler_options))


def tied_loss(full, x):
    """A leaf used twice (lookup and output projection), as tied embeddings are."""
    h = jnp.tanh(jnp.take(full["E"], x, axis=0) @ full["W"])
    return jnp.sum((h @ full["E"].T) ** 2)


def test_tied_leaf_grad_is_summed_then_reduce_scattered_once():
    rng = np.random.default_rng(0)
    params = {"E": jnp.asarray(rng.normal(size=(64, 16)), jnp.float32),
              "W": jnp.asarray(rng.normal(size=(16, 16)) * 0.1, jnp.float32)}
    x = jnp.asarray(rng.integers(0, 64, (8, 4)), jnp.int32)
    dims = {"E": 0, "W": 1}

    def local(shards, x):
        loss = jax.checkpoint(lambda s, x: tied_loss(gather_tree(s, dims), x),
                              policy=REMAT_POLICY)
        g = jax.grad(loss)(shards, x)
        return g, jax.lax.psum(loss(shards, x), "data")

    specs = {"E": P("data"), "W": P(None, "data")}
    f = smap(local, (specs, P("data")), (specs, P()))
    grads, loss = f(params, x)
    ref_loss, ref_grads = jax.value_and_grad(tied_loss)(params, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, **GRADS, what="grads")
    hlo = f.lower(params, x).compile().as_text()
    cb = collective_bytes(hlo)
    assert cb.counts["reduce_scatter"] == 2  # one per leaf, though E is used twice
    # and the backward re-gathers E and W rather than keeping them alive (4 = 2 leaves x 2)
    assert cb.counts["all_gather"] == 4


def _stack_fn(p, h):
    return h + jnp.tanh(h @ p["a"]) @ p["b"] * p["s"]


@pytest.mark.parametrize(("prefetch", "bucket", "tpu"), [
    (0, False, False), (1, False, False), (2, False, False), (3, False, False),
    (0, True, False), (1, True, False), (2, True, False),
    (1, True, True), (2, False, True)])  # tpu: the TPU record's Comm flags
def test_scheduled_scan_matches_plain_scan(prefetch, bucket, tpu):
    L, D, F = 4, 16, 32
    rng = np.random.default_rng(1)
    params = {"a": jnp.asarray(rng.normal(size=(L, D, F)) * 0.2, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(L, F, D)) * 0.2, jnp.float32),
              "s": jnp.asarray(rng.normal(size=(L, D)), jnp.float32)}  # persistent (replicated)
    x = jnp.asarray(rng.normal(size=(16, D)), jnp.float32)
    dims = {"a": 2, "b": 1, "s": None}
    leaves_dims = tuple(jax.tree.leaves(dims, is_leaf=lambda d: d is None))
    comm = Comm(prefetch_before_vjp=tpu, keep_casts_in_loops=tpu)
    spec = ScheduleSpec(dims=leaves_dims, prefetch=prefetch, bucket=bucket, comm=comm)

    def ref(params, x):
        return jnp.sum(jax.lax.scan(lambda h, p: (_stack_fn(p, h), None), x, params)[0] ** 2)

    def local(shards, x):
        def loss(s, x):
            return jnp.sum(scheduled_scan(_stack_fn, s, x, spec=spec) ** 2)
        (val, (gs, gx)) = jax.value_and_grad(loss, argnums=(0, 1))(shards, x)
        gs["s"] = jax.lax.psum(gs["s"], "data")  # persistent leaves: caller all-reduces
        return jax.lax.psum(val, "data"), gs, gx

    specs = {"a": P(None, None, "data"), "b": P(None, "data"), "s": P()}
    f = smap(local, (specs, P("data")), (P(), specs, P("data")))
    val, grads, gx = f(params, x)
    ref_val, (ref_grads, ref_gx) = jax.value_and_grad(ref, argnums=(0, 1))(params, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    assert_trees_close(grads, ref_grads, **GRADS, what="grads")
    np.testing.assert_allclose(gx, ref_gx, **GRADS)
    cb = collective_bytes(f.lower(params, x).compile().as_text())
    sharded = (D * F + F * D) * L * 4
    k = min(prefetch, L)
    # forward + backward re-gather, and the k prefetches the backward issues past layer 0
    assert cb.all_gather == 2 * sharded + k * sharded // L
    assert cb.reduce_scatter == sharded
    # two leaves; with prefetch a bucket moves both as one collective (tiled on other dims)
    per_layer = 1 if bucket and k else 2
    assert cb.counts["all_gather"] == per_layer * (2 * L + k)
    assert cb.counts["reduce_scatter"] == per_layer * L


@pytest.mark.parametrize(("cap", "per_layer"), [(6144, 1), (6143, 2), (4096, 2), (2048, 3)])
def test_a_layer_over_the_bucket_cap_gathers_in_runs_of_leaves(monkeypatch, cap, per_layer):
    """A layer's three sharded leaves gather 2048 bytes each: one bucket up to a cap of
    6144, below it gathered in runs of consecutive leaves up to the cap (two leaves, then
    one), leaf by leaf at 2048, and its gradients reduced leaf by leaf (the bucket's copies
    cost a layer's worth each: ``BUCKET_CAP_BYTES``). Values and gradients as a plain scan
    either way."""
    from zjax.partition import _schedule_spec

    monkeypatch.setattr(_schedule_spec, "BUCKET_CAP_BYTES", cap)
    L, D, F = 4, 16, 32
    rng = np.random.default_rng(3)
    params = {k: jnp.asarray(rng.normal(size=shape) * 0.2, jnp.float32)
              for k, shape in (("a", (L, D, F)), ("b", (L, F, D)), ("c", (L, D, F)))}
    spec = ScheduleSpec(dims=(2, 1, 2), prefetch=1, bucket=True, comm=Comm())

    def layer(p, h):
        return jnp.tanh(jnp.tanh(h @ p["a"]) @ p["b"]) @ p["c"] @ p["b"]

    def local(shards, x):  # each device's own rows' loss; the gradients summed over them
        loss, grads = jax.value_and_grad(lambda s: jnp.sum(scheduled_scan(
            layer, s, x, spec=spec) ** 2))(shards)
        return loss[None], grads

    specs = {"a": P(None, None, "data"), "b": P(None, "data"), "c": P(None, None, "data")}
    f = smap(local, (specs, P("data")), (P("data"), specs))
    x = jnp.asarray(rng.normal(size=(16, D)), jnp.float32)
    cb = collective_bytes(f.lower(params, x).compile().as_text())
    assert cb.counts["all_gather"] == per_layer * (2 * L + 1)
    # the gradients of a layer over the cap: leaf by leaf (no joined copy of a run)
    assert cb.counts["reduce_scatter"] == (1 if per_layer == 1 else 3) * L
    want = jax.value_and_grad(lambda p: jnp.sum(jax.lax.scan(
        lambda h, w: (layer(w, h), None), x, p)[0] ** 2))(params)
    loss, grads = f(params, x)
    np.testing.assert_allclose(loss.sum(), want[0], rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(grads[k], want[1][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("prefetch", "bucket", "cap"), [(0, False, None), (1, False, None),
                                                          (1, True, None), (2, True, None),
                                                          (1, True, 2048)])
def test_scheduled_scan_with_a_secondary_partition_matches_plain_scan(monkeypatch, prefetch,
                                                                      bucket, cap):
    """hpZ's two levels on node 2 x data 4 (shards over ("data", "node")), per leaf and as
    buckets: values and gradients as a plain scan; per layer the backward gathers over
    ``data`` only, and the gradients are reduce-scattered over ``data`` then ``node``. A
    layer over the bucket cap (``cap``: each 2048-byte leaf alone) moves as leaf by leaf."""
    from zjax.partition import Comm, _schedule_spec
    from zjax.runtime.mesh import split_nodes

    if cap is not None:
        monkeypatch.setattr(_schedule_spec, "BUCKET_CAP_BYTES", cap)

    L, D, F = 4, 16, 32
    rng = np.random.default_rng(2)
    params = {"a": jnp.asarray(rng.normal(size=(L, D, F)) * 0.2, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(L, F, D)) * 0.2, jnp.float32),
              "s": jnp.asarray(rng.normal(size=(L, D)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(16, D)), jnp.float32)
    dims = {"a": 2, "b": 1, "s": None}
    spec = ScheduleSpec(dims=tuple(jax.tree.leaves(dims, is_leaf=lambda d: d is None)),
                        prefetch=prefetch, bucket=bucket, comm=Comm(node_axis="node"))
    mesh = split_nodes(zjax.make_mesh(), 4)
    axes = ("data", "node")

    def local(shards, x):
        def loss(s, x):
            return jnp.sum(scheduled_scan(_stack_fn, s, x, spec=spec) ** 2)
        (val, (gs, gx)) = jax.value_and_grad(loss, argnums=(0, 1))(shards, x)
        gs["s"] = jax.lax.psum(gs["s"], axes)
        return jax.lax.psum(val, axes), gs, gx

    specs = {"a": P(None, None, axes), "b": P(None, axes), "s": P()}
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axes)),
                              out_specs=(P(), specs, P(axes)), check_vma=False),
                compiler_options=dict(backend("cpu").compiler_options))
    val, grads, gx = f(params, x)

    def ref(params, x):
        return jnp.sum(jax.lax.scan(lambda h, p: (_stack_fn(p, h), None), x, params)[0] ** 2)

    ref_val, (ref_grads, ref_gx) = jax.value_and_grad(ref, argnums=(0, 1))(params, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    assert_trees_close(grads, ref_grads, **GRADS, what="grads")
    np.testing.assert_allclose(gx, ref_gx, **GRADS)
    coll = collective_bytes(f.lower(params, x).compile().as_text(), mesh_axes=dict(mesh.shape))
    sharded = (D * F + F * D) * L * 4
    k = min(prefetch, L)
    # across nodes: each layer once (a quarter of it), in the forward (and its k prefetches)
    assert coll.by_axis["node"]["all_gather"] == (L + k) * sharded // L // 4
    # within the node: the forward's second level and the backward's re-gathers
    assert coll.by_axis["data"]["all_gather"] == 2 * sharded + k * sharded // L
    assert coll.by_axis["data"]["reduce_scatter"] == sharded
    # per leaf, each layer's cross-node level runs during the next layer (and the first
    # iteration sends zeros); buckets run both levels at the end of their layer
    extra = 0 if bucket and k and cap is None else sharded // L
    assert coll.by_axis["node"]["reduce_scatter"] == (sharded + extra) // 4


class _Leaky(nnx.Module):
    """Uses a Stack's parameter outside the Stack: a shard, never gathered."""

    def __init__(self, rngs):
        self.stack = Stack(lambda r: nnx.Linear(16, 16, use_bias=False, rngs=r), 2, rngs=rngs)

    def __call__(self, x):
        return self.stack(x) @ self.stack.layers.kernel[...][0].T


def test_ungathered_use_names_the_sharded_leaves():
    def loss(model, batch):
        return jnp.sum(model(batch.astype(jnp.float32)) ** 2), jnp.asarray(1.0)

    trainable = zjax.from_nnx(_Leaky, loss)
    zero = zjax.ZeroConfig(stage=3, param_persistence_threshold=0)
    zstep = zjax.make_step(trainable, optax.sgd(0.1), zero=zero, mesh=zjax.make_mesh())
    state = zstep.init(jax.random.key(0))
    batch = jnp.ones((8, 16), jnp.int32)
    with pytest.raises(zjax.NotGatheredError, match="stack/layers/kernel"):
        zstep.step(state, jax.device_put(batch, zstep.batch_sharding))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(("method", "longest"), [("all_reduce", 16), ("ring", 16),
                                                 ("ring", 2), ("ring", 4)])
def test_reduce_scatter_methods_are_the_same_sum(dim, method, longest):
    """The multi-process CPU fallback (all-reduce + own slice) and the TPU ring of
    collective-permutes give each device its slice of the sum, like the reduce-scatter; their
    HLO holds no reduce-scatter, and the reader counts the ring as one (its full tensor).
    Rings shorter than the devices (``ring_longest``: 2 x 2 x 2 or 4 x 2 rings within rings,
    as 1,024 TPU chips run 16 x 16 x 4) give the same sum in fewer hops, read the same."""
    from zjax.partition.gather import reduce_scatter, ring_factors

    x = np.random.default_rng(0).standard_normal((N * 16, 24)).astype(np.float32)

    def local(a, method):  # device d contributes [a_d, 2 a_d, ..., N a_d] along dim
        t = jnp.concatenate([a * (k + 1) for k in range(N)], axis=dim)
        return reduce_scatter(t, "data", dim=dim, method=method, ring_longest=longest)

    out = P("data") if dim == 0 else P(None, "data")
    total = x.reshape(N, 16, 24).sum(0)
    expected = np.concatenate([total * (k + 1) for k in range(N)], axis=dim)
    for m in ("direct", method):
        f = smap(lambda a, m=m: local(a, m), (P("data"),), out)
        np.testing.assert_allclose(f(x), expected, rtol=1e-5, atol=1e-5)
    text = smap(lambda a: local(a, method), (P("data"),), out).lower(x).compile().as_text()
    cb = collective_bytes(text)
    assert "reduce-scatter(" not in text
    if method == "all_reduce":
        assert cb.all_reduce > 0
    else:  # N - 1 hops of one tile each, read as one reduce-scatter of the full tensor
        hops = sum(f - 1 for f in ring_factors(N, longest=longest))
        assert hops == {16: N - 1, 2: 3, 4: 4}[longest]
        assert text.count("collective-permute(") == hops
        assert cb.reduce_scatter == N * 16 * 24 * 4 and cb.counts["reduce_scatter"] == 1
        assert cb.collective_permute == 0 and cb.wire == cb.reduce_scatter


def test_a_cast_kept_in_the_loop_gives_the_converts_values():
    """``Comm.keep_casts_in_loops`` (libtpu) rounds before it converts: float32 -> bfloat16
    bit for bit as ``astype`` (ties to even, float32 denormals, inf, nan); to float16, whose
    denormals ``reduce_precision`` would flush, it converts plainly."""
    rng = np.random.default_rng(0)
    scaled = rng.normal(size=4096) * 10.0 ** rng.integers(-40, 39, 4096)
    special = [1.00390625, 1.01171875, 3e-5, 1e-40, np.inf, -np.inf, np.nan]
    x = jnp.asarray(np.concatenate([scaled, special]).astype(np.float32))
    for dtype in (jnp.bfloat16, jnp.float16):
        kept = Comm(gather_dtype=dtype, keep_casts_in_loops=True).cast(x)
        want = x.astype(dtype)
        assert kept.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(kept).view(np.uint16),
                                      np.asarray(want).view(np.uint16))

