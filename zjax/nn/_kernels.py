"""Fused attention kernels of the accelerators, behind one calling convention.

Each takes ``q [B, T, H, D]``, ``k``/``v`` ``[B, S, K, D]``, segment ids ``(q [B, T],
kv [B, S])`` or None and a :class:`~zjax.nn._blockwise.Mask`, and returns ``[B, T, H, D]``.
``refusal`` says why a kernel cannot honour a request (None: it can), so a caller never runs
one without its mask.

- ``splash`` (TPU): Pallas Mosaic splash attention: causal / local masks, segment ids,
  logit soft-cap; grouped-query attention as one multi-query kernel per key/value head.
- ``triton`` (GPU): Pallas Triton FlashAttention: causal, segment ids; key/value heads are
  repeated to the query heads (the kernel has no grouping); no window, no soft-cap.
- ``cudnn`` (GPU): ``jax.nn.dot_product_attention(implementation="cudnn")``: causal,
  sliding window, grouped-query; no segment ids, no soft-cap; needs the cuDNN wheel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zjax.nn._blockwise import Mask

__all__ = ["KERNELS", "cudnn_loads", "refusal", "run"]

KERNELS = ("splash", "triton", "cudnn")
_SPLASH_BLOCKS = (512, 256, 128)  # the largest that divides the length is used
_TRITON_BLOCK = 128


@functools.cache
def cudnn_loads() -> bool:
    """Whether JAX finds the cuDNN library (the ``nvidia-cudnn-cu12`` wheel, or a system
    cuDNN), as its cuDNN attention needs even to compile for a compile-only GPU target."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception:  # not found, or a JAX that moved the check: then not known to load
        return False
    return True


def _splash_block(n: int) -> int | None:
    return next((b for b in _SPLASH_BLOCKS if n % b == 0), None)


def refusal(kernel: str, mask: Mask, *, q_len: int, kv_len: int, head_dim: int,
            segments: bool) -> str | None:
    """Why ``kernel`` cannot compute this attention exactly, or None."""
    if q_len != kv_len:
        return f"it needs as many queries as keys (got {q_len} and {kv_len})"
    if kernel == "splash":
        if _splash_block(q_len) is None:
            return f"the sequence length {q_len} is not a multiple of 128"
        return None
    if kernel == "triton":
        if mask.window is not None:
            return "the Pallas Triton kernel has no sliding window"
        if mask.softcap is not None:
            return "the Pallas Triton kernel has no logit soft-cap"
        if q_len % _TRITON_BLOCK:
            return f"the sequence length {q_len} is not a multiple of {_TRITON_BLOCK}"
        return None
    if kernel == "cudnn":
        if segments:
            return "cuDNN attention in JAX takes no segment ids (packed documents)"
        if mask.softcap is not None:
            return "cuDNN attention in JAX has no logit soft-cap"
        if head_dim > 128:
            return (f"a head of {head_dim} dimensions: JAX allows cuDNN only up to 128 when "
                    "it cannot see a Hopper GPU (compile-only targets)")
        return None
    raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(KERNELS)}")


def _splash(q, k, v, segment_ids, mask: Mask, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    if mask.window is not None:
        base = sa.LocalMask((t, s), window_size=(mask.window - 1, 0 if mask.causal else None),
                            offset=0)
    elif mask.causal:
        base = sa.CausalMask((t, s))
    else:
        base = sa.FullMask((t, s))
    bq, bkv = _splash_block(t), _splash_block(s)
    blocks = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                           block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                           block_kv_dq=bkv)
    kernel = sa.make_splash_mqa(sa.MultiHeadMask([base] * (h // kh)), block_sizes=blocks,
                                head_shards=1, q_seq_shards=1,
                                attn_logits_soft_cap=mask.softcap, interpret=interpret)
    # [B, K, G, T, D] queries against [B, K, S, D] keys: one multi-query call per kv head
    qg = jnp.moveaxis((q * mask.scale).astype(q.dtype).reshape(b, t, kh, h // kh, d), 1, 3)
    kt, vt = jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2)
    if segment_ids is None:
        per_head = jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv))
        out = jax.vmap(per_head)(qg, kt, vt)
    else:
        seg = sa.SegmentIds(q=segment_ids[0].astype(jnp.int32),
                            kv=segment_ids[1].astype(jnp.int32))
        per_head = jax.vmap(lambda qq, kk, vv, sg: kernel(qq, kk, vv, segment_ids=sg),
                            in_axes=(0, 0, 0, None))
        out = jax.vmap(per_head)(qg, kt, vt, seg)
    return jnp.moveaxis(out, 3, 1).reshape(b, t, h, d)


def _triton(q, k, v, segment_ids, mask: Mask, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention as pa

    h, kh = q.shape[2], k.shape[2]
    if kh != h:  # the kernel indexes key/value heads by the query head
        k, v = jnp.repeat(k, h // kh, axis=2), jnp.repeat(v, h // kh, axis=2)
    seg = None if segment_ids is None else segment_ids[0].astype(jnp.int32)
    blocks = pa.BlockSizes(block_q=_TRITON_BLOCK, block_k=_TRITON_BLOCK,
                           block_q_dkv=_TRITON_BLOCK, block_kv_dkv=_TRITON_BLOCK,
                           block_q_dq=_TRITON_BLOCK, block_kv_dq=_TRITON_BLOCK)
    return pa.mha(q, k, v, seg, sm_scale=mask.scale, causal=mask.causal, block_sizes=blocks,
                  interpret=interpret)


def _cudnn(q, k, v, segment_ids, mask: Mask, interpret: bool):
    del segment_ids, interpret  # refused above; cuDNN has no interpreter
    window = None
    if mask.window is not None:
        window = (mask.window - 1, 0 if mask.causal else mask.window - 1)
    return jax.nn.dot_product_attention(q, k, v, scale=mask.scale, is_causal=mask.causal,
                                        local_window_size=window, implementation="cudnn")


def run(kernel: str, q, k, v, segment_ids, mask: Mask, *, interpret: bool = False):
    """``kernel`` on the arrays (``interpret``: Pallas' interpreter, for CPU tests)."""
    fn = {"splash": _splash, "triton": _triton, "cudnn": _cudnn}[kernel]
    return fn(q, k, v, segment_ids, mask, interpret)
