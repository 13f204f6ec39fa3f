"""Dropless expert parallelism moves the routed rows only (``zjax.nn._ragged``).

- The layer under an ``expert`` axis of 8 (every simulated device one expert) or 4 (two each),
  the assignments exchanged by the chunked ragged all-to-all XLA:CPU runs, equals the same
  layer on one device, values and every gradient (``helpers.FP32``): an even routing, and ones
  that send every token to experts 0 and 1 (several rounds; the receive buffer filled to its
  bound).
- The compiled step's all-to-all bytes are the routed rows: ``tokens x k x d_model`` per
  exchange, two exchanges a layer, forward, recomputation and backward, plus a few bytes of
  per-expert counts, on XLA:CPU (chunked), ``h100:2x4`` and ``v5p:2x2x2``
  (``ragged-all-to-all``; its output is a worst-case buffer, its operand the rows sent).
- No two collectives of the compiled XLA:CPU step can run at once and share a rendezvous
  (:func:`zjax.planning.unordered_collectives`): the chunked exchange's loops, the pieces of
  ``moe_chunks``, the recomputed forward against the backward, and the loss's batch-wide
  sums against the layers' router sums. Such a pair crashed the step read back from JAX's
  compilation cache (a segmentation fault in XLA:CPU's all-reduce).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import FP32, assert_trees_close, compiled_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.nn.moe import Experts, moe_ffn
from zjax.runtime.mesh import EXPERT

E, K, N, D, F = 8, 2, 24, 16, 24  # N tokens per device


def _inputs(skew: float, ep: int):
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (ep * N, D), jnp.float32)
    router = jax.random.normal(keys[1], (D, E), jnp.float32)
    # a constant feature and a large weight on it: every token's top-2 are experts 0 and 1
    x, router = x.at[:, 0].set(3.0), router.at[0, :2].add(skew)
    w = Experts(*(0.3 * jax.random.normal(kk, s, jnp.float32) for kk, s in
                  zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)))
    return x, router, w


def _parallel(mesh, k, chunks, x, router, *w):
    def layer(x, router, *w):
        return moe_ffn(x, router, Experts(*w), k=k, matmul="tiled", exchange="chunked",
                       chunks=chunks)[0]

    split = P(EXPERT)
    return jax.shard_map(layer, mesh=mesh, in_specs=(split, P(), split, split, split),
                         out_specs=split, check_vma=False)(x, router, *w)


@pytest.mark.parametrize(("skew", "k", "ep", "chunks"), [
    (0.0, K, 8, 1), (20.0, K, 8, 1), (20.0, K, 4, 1), (20.0, 3, 4, 1), (20.0, K, 4, 16)],
    ids=["even-e8", "skewed-e8", "all-to-device-0-e4", "top3-fills-e4", "in-8-pieces-e4"])
def test_the_exchange_equals_one_device(skew, k, ep, chunks):
    """Skewed, every token's first two experts are 0 and 1: on 8 devices each of devices 0
    and 1 receives one row from every token (``min(k, experts per device)``: its bound); on 4
    both live on device 0, which receives two from every token (the bound again, with top-3's
    third expert elsewhere). ``moe_chunks`` 16 on 24 tokens a device: 8 independent pieces
    (their greatest common divisor)."""
    x, router, w = _inputs(skew, ep)
    top = jax.lax.top_k(x @ router, k)[1]
    if skew:
        assert set(top[:, :2].reshape(-1).tolist()) == {0, 1}
    mesh = jax.make_mesh((ep,), (EXPERT,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:ep])
    ct = jax.random.normal(jax.random.key(9), x.shape, jnp.float32)

    def loss(layer):
        return lambda x, r, *w: jnp.sum(ct * layer(x, r, *w))

    one = loss(lambda x, r, *w: moe_ffn(x, r, Experts(*w), k=k, matmul="tiled")[0])
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P(EXPERT)))
    args = (put(x), jax.device_put(router, NamedSharding(mesh, P())), *map(put, w))
    many = jax.jit(jax.value_and_grad(loss(functools.partial(_parallel, mesh, k, chunks)),
                                      argnums=range(5)))
    want = jax.value_and_grad(one, argnums=range(5))(x, router, *w)
    assert abs(float(want[0])) > 1.0
    # scaled: the exchange sums each row's experts in another order (skewed-e8's x-grad: 2.9e-5
    # off at 0.13, in a leaf whose entries reach 6.2, on an AMD EPYC)
    assert_trees_close(many(*args), want, **FP32, what="value and grads", scaled=True)


@pytest.mark.parametrize("extra", [(), pytest.param(("model.moe_chunks=2", "model.mtp_layers=1"),
                                                    marks=pytest.mark.slow)],
                         ids=["one-exchange", "in-pieces-with-mtp"])
def test_no_two_collectives_of_the_cpu_step_can_collide(extra):
    from zjax.planning import unordered_collectives

    _, compiled, _ = compiled_for(
        "cpu", "model.n_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64",
        "mesh.expert=2", "zero.stage=2", *extra, file="configs/llama-tiny.yaml")
    assert unordered_collectives(compiled.as_text()) == []


@pytest.mark.slow  # compiles for the H100 and v5p targets
@pytest.mark.parametrize("name", ["cpu", "h100:2x4", "v5p:2x2x2"])
def test_dropless_all_to_all_bytes_are_the_routed_rows(name):
    from zjax.planning import collective_sites

    # d_model 256: a TPU pads a bfloat16 row under 256 wide to a pair of rows
    tokens, k, d, layers = 16 * 64 // 8, 2, 256, 2  # per device; TARGET_BASE's 2 layers
    _, compiled, report = compiled_for(
        name, "model.n_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64",
        "model.d_model=256", "mesh.expert=2", "data.batch_size=16",
        file="configs/llama-tiny.yaml")
    sites = [s for s in collective_sites(compiled.as_text(), decomposed=name != "cpu")
             if s.kind == "all_to_all"]
    rows = sum(s.nbytes * s.weight for s in sites if s.nbytes >= 1024)
    counts = sum(s.nbytes * s.weight for s in sites if s.nbytes < 1024)
    assert rows == 3 * 2 * layers * tokens * k * d * 2
    assert 0 < counts <= 3 * 2 * layers * 4 * 4 * 2  # the [expert]-sized counts and offsets
    assert report.experts["all_to_all_bytes"] == rows + counts
    if name != "cpu":
        assert any("ragged-all-to-all" in s.line for s in sites)
