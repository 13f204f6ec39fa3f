"""Attention over a sequence split on a ``context`` mesh axis (``zjax.nn.context``): Ulysses'
all-to-all and ring attention equal dense attention on the whole sequence, forward and
backward (fp32: 1e-4 on outputs and gradients of O(1), measured ~1e-6), for C = 2 and 4,
causal with packed segments, a window and a soft-cap, grouped-query heads; and the
collectives of the compiled forward are the formulas' bytes on every compiler:
Ulysses 4 x B x T/C x H x D (q, k, v, out; key/value heads repeated to C when fewer), ring
(C - 1) x the local K and V."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_on
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.errors import ArgumentError
from zjax.nn.attention import attention
from zjax.nn.context import ring_attention, stripe, ulysses_attention, unstripe
from zjax.planning import collective_bytes
from zjax.runtime.targets import target

SPEC = P("data", "context")
TOL = dict(atol=1e-4, rtol=0)


def _mesh(c: int, devices=None):
    return jax.make_mesh((8 // c, c), ("data", "context"), axis_types=(AxisType.Auto,) * 2,
                         devices=devices)


def _split(kind: str, c: int, devices=None, *, seg: bool = False, striped: bool = True,
           **opts):
    """The sequence-split attention as a function of whole ``q, k, v`` (and segment ids)."""
    def local(q, k, v, ids):
        if kind == "ring":
            return ring_attention(q, k, v, axis_name="context", segment_ids=ids,
                                  striped=striped, block_size=8, **opts)
        return ulysses_attention(q, k, v, axis_name="context", segment_ids=ids,
                                 implementation="blockwise", block_size=16, **opts)

    run = jax.shard_map(local, mesh=_mesh(c, devices),
                        in_specs=(SPEC, SPEC, SPEC, SPEC if seg else None), out_specs=SPEC,
                        check_vma=False)
    if kind != "ring" or not striped:
        return run
    s = lambda x: None if x is None else stripe(x, c)
    return lambda q, k, v, ids: unstripe(run(s(q), s(k), s(v), s(ids)), c)


CASES = [dict(), dict(seg=True), dict(window=12, softcap=3.0), dict(seg=True, heads=(4, 1))]


# the quick suite runs one case each (C = 4, packed segments); the rest are slow
GRID = [pytest.param(kind, c, case, marks=() if (c, case) == (4, 1) else pytest.mark.slow)
        for kind in ("ring", "ring-contiguous", "ulysses") for c in (2, 4)
        for case in range(len(CASES))]


@pytest.mark.parametrize(("kind", "c", "case"), GRID)
def test_split_attention_equals_dense_attention_forward_and_backward(kind, c, case):
    opts = dict(CASES[case])
    seg, (h, kh) = opts.pop("seg", False), opts.pop("heads", (4, 2))
    rng = np.random.default_rng(case)
    b, t, d = 8 // c, 64, 8
    q, k, v, ct = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32)
                   for n in (h, kh, kh, h))
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32) if seg else None
    split = _split(kind.split("-")[0], c, seg=seg, striped=kind == "ring", **opts)

    def dense(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids=ids, implementation="dense", **opts) * ct)

    want, want_grads = jax.value_and_grad(dense, argnums=(0, 1, 2))(q, k, v)
    got, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(split(*a, ids) * ct),
                                            argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def _forward_bytes(kind: str, c: int, kh: int, name: str):
    devices = None if name == "cpu" else target(name).devices
    mesh = _mesh(c, devices)
    # XLA:CPU widens 16-bit all-to-alls to float32: measure it in float32
    dtype = jnp.float32 if name == "cpu" else jnp.bfloat16
    args = [jax.ShapeDtypeStruct((8 // c, 1024, n, 64), dtype,
                                 sharding=NamedSharding(mesh, SPEC)) for n in (8, kh, kh)]
    fn = jax.jit(lambda q, k, v: _split(kind, c, devices, striped=False)(q, k, v, None))
    compiled = compile_on(fn.lower(*args), mesh.devices.flat)
    return collective_bytes(compiled.as_text()), jnp.dtype(dtype).itemsize


def _check_bytes(name: str):
    for c in (2, 4):
        for kh in (8, 2):
            local = 1024 // c * 64  # one head of the local tokens, per device (batch 1)
            got, size = _forward_bytes("ulysses", c, kh, name)
            heads = 8 + 8 + 2 * max(kh, c)  # q, out; k, v repeated to c heads when fewer
            assert got.all_to_all == heads * local * size, (name, c, kh)
            got, size = _forward_bytes("ring", c, kh, name)
            assert got.collective_permute == (c - 1) * 2 * kh * local * size, (name, c, kh)


def test_forward_collective_bytes_are_the_formulas_on_cpu():
    _check_bytes("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["h100:2x4", "v5p:2x2x2"])
def test_forward_collective_bytes_are_the_formulas_compiled_for(name):
    _check_bytes(name)


def test_heads_the_context_axis_cannot_split_are_refused():
    q = jnp.zeros((4, 32, 6, 8))
    with pytest.raises(ArgumentError, match=r"6 query heads do not divide by a context axis "
                                            r"of 4.*ring attention"):
        jax.eval_shape(_split("ulysses", 4), q, q, q, None)
    q, kv = jnp.zeros((4, 32, 4, 8)), jnp.zeros((4, 32, 3, 8))
    with pytest.raises(ArgumentError, match=r"3 key/value heads and a context axis of 2"):
        jax.eval_shape(_split("ulysses", 2), q, kv, kv, None)
    q = jnp.zeros((2, 36, 4, 8))
    with pytest.raises(ArgumentError, match=r"36 tokens does not split into 2 x 4 equal"):
        jax.eval_shape(_split("ring", 4), q, q, q, None)
    with pytest.raises(ArgumentError, match=r"local length 9 must split into 1 chunk"):
        jax.eval_shape(_split("ring", 4, striped=False), q, q, q, None)
