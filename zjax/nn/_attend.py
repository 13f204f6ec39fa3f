"""The single-device attention behind :func:`zjax.nn.attention.attention`: the kernel choice,
the dense reference and the checks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zjax.errors import ArgumentError
from zjax.nn import _kernels
from zjax.nn._blockwise import Mask, blockwise_attention

__all__ = ["DENSE_UP_TO", "IMPLEMENTATIONS", "choose", "dense_attention", "local_attention",
           "platform_kind", "trace_platform"]

IMPLEMENTATIONS = ("auto", "dense", "blockwise", *_kernels.KERNELS)
# XLA:CPU, forward + backward at 8192 tokens (benchmarks/attention.py kernels): blockwise /
# dense 1.50 at 256 keys, 0.74 at 512, 0.49 at 1024, 0.19 at 2048
DENSE_UP_TO = 256
_NEG = -1e30


def trace_platform() -> str:
    """The platform of the mesh being traced under (``cpu``, ``gpu``, ``tpu``), else the
    default backend's: a compile-only target's mesh names its own."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    return platform_kind(device.platform if device is not None else jax.default_backend())


def platform_kind(platform: str) -> str:
    """``cpu``, ``gpu`` or ``tpu`` for a device's platform name (``cuda`` and ``rocm`` are
    ``gpu``)."""
    return "gpu" if platform in ("cuda", "rocm") else platform


def choose(platform: str, mask: Mask, *, q_len: int, kv_len: int, head_dim: int,
           segments: bool) -> str:
    """The implementation ``auto`` runs on ``platform`` for this request."""
    ask = dict(q_len=q_len, kv_len=kv_len, head_dim=head_dim, segments=segments)
    if platform == "tpu" and _kernels.refusal("splash", mask, **ask) is None:
        return "splash"
    if platform == "gpu":
        # cuDNN where its library loads: grouped-query attention without repeating the keys
        # and values, a third of Triton's temp at 8192 tokens with 8 heads over 2 (measured)
        if _kernels.cudnn_loads() and _kernels.refusal("cudnn", mask, **ask) is None:
            return "cudnn"
        if _kernels.refusal("triton", mask, **ask) is None:
            return "triton"
    if platform not in ("tpu", "gpu") and kv_len <= DENSE_UP_TO:
        return "dense"
    return "dense" if q_len != kv_len and q_len <= 16 else "blockwise"  # decoding steps


def dense_attention(q, k, v, segment_ids=None, *, mask: Mask, q_start=None) -> jax.Array:
    """The reference: ``[B, K, G, T, S]`` float32 scores, masked softmax, weighted sum.

    ``q_start``: position of the first query (may be traced: decoding); default ``S - T``.
    """
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * mask.scale
    if mask.softcap is not None:
        scores = mask.softcap * jnp.tanh(scores / mask.softcap)
    qpos = (s - t if q_start is None else q_start) + jnp.arange(t)
    kpos = jnp.arange(s)
    ok = jnp.ones((t, s), bool)
    if mask.causal:
        ok &= qpos[:, None] >= kpos[None, :]
    if mask.window is not None:
        ok &= qpos[:, None] - kpos[None, :] < mask.window
    ok = ok[None, None, None]
    if segment_ids is not None:
        ok = ok & (segment_ids[0][:, :, None] == segment_ids[1][:, None, :])[:, None, None]
    probs = jax.nn.softmax(jnp.where(ok, scores, _NEG), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, h, d)


def _check(q, k, v, window, softcap, causal, segment_ids):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ArgumentError("attention", f"q [B, T, H, D] and k, v [B, S, K, D] expected, got "
                            f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % k.shape[2] or q.shape[-1] != k.shape[-1]:
        raise ArgumentError("attention", f"{k.shape[2]} key/value heads do not divide "
                            f"{q.shape[2]} query heads (or head sizes differ)")
    if window is not None and (not causal or window < 1):
        raise ArgumentError("attention", f"a sliding window ({window}) needs causal attention "
                            "and at least 1 position")
    if softcap is not None and not softcap > 0:
        raise ArgumentError("attention", f"the logit soft-cap must be positive, got {softcap}")
    if segment_ids is not None and (segment_ids[0].shape != q.shape[:2]
                                    or segment_ids[1].shape != k.shape[:2]):
        raise ArgumentError("attention", "segment ids must be [B, T] (and [B, S] for keys), "
                            f"got {segment_ids[0].shape}, {segment_ids[1].shape}")


def local_attention(q, k, v, *, segment_ids=None, causal: bool = True,
                    window: int | None = None, softcap: float | None = None,
                    scale: float | None = None, implementation: str = "auto", q_start=None,
                    interpret: bool = False, block_size: int = 512) -> jax.Array:
    """:func:`zjax.nn.attention.attention` over the tokens given, whatever the mesh (what
    Ulysses runs on its whole-length, head-split sequences)."""
    if segment_ids is not None and not isinstance(segment_ids, tuple | list):
        segment_ids = (segment_ids, segment_ids)
    _check(q, k, v, window, softcap, causal, segment_ids)
    mask = Mask(causal, window, softcap, float(scale if scale is not None
                                               else 1 / math.sqrt(q.shape[-1])))
    ask = dict(q_len=q.shape[1], kv_len=k.shape[1], head_dim=q.shape[-1],
               segments=segment_ids is not None)
    impl = implementation
    if impl == "auto":
        impl = "dense" if q_start is not None else choose(trace_platform(), mask, **ask)
    if impl not in IMPLEMENTATIONS:
        raise ArgumentError("model.attention", f"{impl!r} is not an attention implementation; "
                            f"choose one of {', '.join(IMPLEMENTATIONS)}")
    if q_start is not None and impl != "dense":
        raise ArgumentError("model.attention", f"{impl} attention cannot start queries at a "
                            "traced position (decoding); use dense")
    if impl == "dense":
        return dense_attention(q, k, v, segment_ids, mask=mask, q_start=q_start)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, segment_ids, causal=causal, window=window,
                                   softcap=softcap, scale=mask.scale, block_q=block_size,
                                   block_k=block_size)
    why = _kernels.refusal(impl, mask, **ask)
    if why is not None:
        raise ArgumentError("model.attention", f"{impl} attention cannot compute this "
                            f"request: {why}; choose auto or blockwise")
    return _kernels.run(impl, q, k, v, segment_ids, mask, interpret=interpret)
