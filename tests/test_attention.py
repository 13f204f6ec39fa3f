"""``zjax.nn.attention``: every implementation equals dense attention in values and gradients,
``auto`` picks each backend's kernel (and it compiles for the H100 and v5p targets), and a
kernel that cannot honour the mask is refused.

Tolerances: float32 results within 2e-5 absolute of dense (inputs of unit scale, sums of at
most a few hundred terms); bfloat16 within 2% of the largest value (bf16 has 8 bits of
mantissa, and the kernels round probabilities to it before the value matmul).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_on
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zjax.errors import ArgumentError
from zjax.nn._blockwise import Mask
from zjax.nn.attention import IMPLEMENTATIONS, attention, choose

F32_ATOL = 2e-5


def _qkv(b=2, t=96, h=4, kh=2, d=16, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (b, t, h, d), dtype)
    k = jax.random.normal(ks[1], (b, t, kh, d), dtype)
    v = jax.random.normal(ks[2], (b, t, kh, d), dtype)
    return q, k, v


def _two_docs(b: int, t: int, first: int):
    return jnp.concatenate([jnp.ones((b, first), jnp.int32),
                            jnp.full((b, t - first), 2, jnp.int32)], axis=1)


def _value_and_grads(impl, q, k, v, **opts):
    def loss(q, k, v):
        out = attention(q, k, v, implementation=impl, **opts)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out.astype(jnp.float32) * weights)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _assert_matches_dense(impl, q, k, v, atol=F32_ATOL, **opts):
    want, want_g = _value_and_grads("dense", q, k, v, **opts)
    got, got_g = _value_and_grads(impl, q, k, v, **opts)
    np.testing.assert_allclose(got, want, atol=atol * q.size ** 0.5)
    for name, a, e in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(a, e, atol=atol, err_msg=f"d{name}")


MASKS = {
    "causal": {},
    "gqa_window": {"window": 17},
    "softcap": {"softcap": 5.0},
    "segments": {"segment_ids": "docs"},
    "bidirectional": {"causal": False},
    "everything": {"window": 33, "softcap": 3.0, "segment_ids": "docs"},
}


def _opts(name, b, t):
    opts = dict(MASKS[name])
    if opts.get("segment_ids") == "docs":
        opts["segment_ids"] = _two_docs(b, t, 40)
    return opts


@pytest.mark.parametrize("block", [32, 40])
@pytest.mark.parametrize("mask", list(MASKS))
def test_blockwise_equals_dense_in_values_and_gradients(mask, block):
    """Block 40 does not divide 96: the padded tail must not leak into real rows."""
    q, k, v = _qkv()
    _assert_matches_dense("blockwise", q, k, v, block_size=block, **_opts(mask, 2, 96))


def test_blockwise_in_bfloat16_is_dense_to_bf16_rounding():
    q, k, v = _qkv(t=128, dtype=jnp.bfloat16)
    opts = dict(segment_ids=_two_docs(2, 128, 50), window=60)
    want, want_g = _value_and_grads("dense", q, k, v, **opts)
    got, got_g = _value_and_grads("blockwise", q, k, v, block_size=32, **opts)
    for a, e in zip(got_g, want_g, strict=True):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.max(np.abs(a - e)) <= 0.02 * np.max(np.abs(e))
    assert abs(float(got) - float(want)) <= 0.02 * abs(float(want)) + 1.0


@pytest.mark.parametrize("kernel,mask", [("splash", "segments"), ("splash", "everything"),
                                         ("triton", "segments"), ("triton", "causal")])
def test_pallas_kernels_in_their_interpreter_equal_dense(kernel, mask):
    """The TPU and GPU kernels zjax calls, run by Pallas' interpreter on the CPU (GQA: 4
    query heads over 2 key/value heads)."""
    q, k, v = _qkv(b=1, t=256, d=64)
    _assert_matches_dense(kernel, q, k, v, interpret=True, **_opts(mask, 1, 256))


def _mask(**kw):
    return Mask(kw.get("causal", True), kw.get("window"), kw.get("softcap"), 1.0)


def test_auto_picks_each_backends_kernel_and_one_that_honours_the_mask():
    ask = dict(q_len=8192, kv_len=8192, head_dim=128, segments=True)
    assert choose("tpu", _mask(window=4096, softcap=50.0), **ask) == "splash"
    assert choose("gpu", _mask(), **ask) == "triton"
    # the Triton kernel has no window and no cap: blockwise honours both
    assert choose("gpu", _mask(window=4096), **ask) == "blockwise"
    assert choose("gpu", _mask(softcap=30.0), **ask) == "blockwise"
    assert choose("cpu", _mask(), **ask) == "blockwise"
    assert choose("cpu", _mask(), **{**ask, "q_len": 256, "kv_len": 256}) == "dense"
    assert choose("cpu", _mask(), **{**ask, "q_len": 512, "kv_len": 512}) == "blockwise"
    # lengths the kernels' blocks do not divide
    assert choose("tpu", _mask(), **{**ask, "q_len": 1000, "kv_len": 1000}) == "blockwise"
    assert choose("gpu", _mask(), **{**ask, "q_len": 3000, "kv_len": 3000}) == "blockwise"


def test_auto_takes_cudnn_on_gpu_where_it_loads_and_the_mask_allows(monkeypatch):
    """cuDNN needs its library even to compile (the nvidia-cudnn-cu12 wheel: 2.1 GB with
    cuBLAS and NVRTC, not in the targets extra); where it loads, it runs grouped-query
    attention without repeating the keys and values (at 8192 tokens, 8 heads over 2, on
    h100: 0.068 GB of forward+backward temp against Triton's 0.201 GB; 0.068 both for 8
    over 8)."""
    from zjax.nn import _kernels

    monkeypatch.setattr(_kernels, "cudnn_loads", lambda: True)
    ask = dict(q_len=8192, kv_len=8192, head_dim=128, segments=False)
    assert choose("gpu", _mask(), **ask) == "cudnn"
    assert choose("gpu", _mask(window=4096), **ask) == "cudnn"  # local_window_size
    assert choose("gpu", _mask(), **{**ask, "segments": True}) == "triton"
    assert choose("gpu", _mask(softcap=30.0), **ask) == "blockwise"
    assert choose("gpu", _mask(), **{**ask, "head_dim": 256}) == "triton"
    monkeypatch.setattr(_kernels, "cudnn_loads", lambda: False)
    assert choose("gpu", _mask(), **ask) == "triton"


@pytest.mark.parametrize("impl,opts,why", [
    ("triton", {"window": 8}, "no sliding window"),
    ("triton", {"softcap": 5.0}, "no logit soft-cap"),
    ("cudnn", {"segment_ids": "docs"}, "no segment ids"),
    ("splash", {}, "not a multiple of 128"),
])
def test_a_kernel_that_cannot_honour_the_mask_is_refused(impl, opts, why):
    q, k, v = _qkv()
    with pytest.raises(ArgumentError, match=why):
        attention(q, k, v, implementation=impl, **_opts_from(opts))


def _opts_from(opts):
    return {**opts, "segment_ids": _two_docs(2, 96, 40)} if "segment_ids" in opts else opts


def test_bad_requests_name_what_is_wrong():
    q, k, v = _qkv()
    with pytest.raises(ArgumentError, match="choose one of auto, dense"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(ArgumentError, match="needs causal"):
        attention(q, k, v, causal=False, window=4)
    with pytest.raises(ArgumentError, match="do not divide"):
        attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    assert IMPLEMENTATIONS == ("auto", "dense", "blockwise", "splash", "triton", "cudnn")


def _lowered_on(name: str, t: int, **opts):
    """HLO text of a forward+backward of ``auto`` attention under a 1-device mesh of
    ``name``'s devices (inside shard_map, as the zjax step calls it)."""
    from zjax.runtime.targets import target

    mesh = Mesh(np.array(target(name).devices[:1]), ("data",))
    q = jax.ShapeDtypeStruct((2, t, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, t, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, t), jnp.int32)

    def loss(q, k, v, s):
        return jnp.sum(attention(q, k, v, segment_ids=s, **opts).astype(jnp.float32))

    fn = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                       in_specs=(P("data"),) * 4, out_specs=(P("data"),) * 3, check_vma=False)
    return compile_on(jax.jit(fn).lower(q, kv, kv, seg), mesh.devices.flat)


@pytest.mark.parametrize("name,marker", [  # the quick loop: H100's (a v5p compile is slower)
    ("h100:8", "__gpu$xla.gpu.triton"),
    pytest.param("v5p:2x2x2", "tpu_custom_call", marks=pytest.mark.slow)])
def test_auto_compiles_the_targets_kernel_with_linear_memory(name, marker):
    """Forward and backward at 8192 tokens in under a tenth of the dense scores' bytes (2 x 8
    heads x 8192 x 8192 float32: 4 GiB): the score matrix is never materialised (what is
    left is linear in the length: the output, the repeated keys and values on GPU)."""
    compiled = _lowered_on(name, 8192)
    assert marker in compiled.as_text()
    dense_scores = 2 * 8 * 8192 * 8192 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < dense_scores / 10
