"""Blockwise attention in plain JAX (FlashAttention-2's algorithm) with its own backward.

The forward walks key blocks with an online softmax and keeps only the output and the
log-sum-exp of each query row; the backward recomputes each block's probabilities from them.
Neither direction materialises the ``T x S`` score matrix: the working set is one
``block_q x block_k`` tile per head. Blocks that the causal or sliding-window mask hides
entirely are skipped (the loops' bounds depend on the block index), so causal attention costs
about half the score FLOPs of the dense form.

Layout: ``q [B, T, H, D]``, ``k``/``v`` ``[B, S, K, D]`` with ``K`` dividing ``H`` (query
head ``h`` reads key/value head ``h // (H / K)``); query ``i`` is at position ``S - T + i``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["Mask", "blockwise_attention"]

_NEG = -1e30  # masked score: finite, so a row whose first blocks are all hidden stays NaN-free


class Mask(NamedTuple):
    """What a query may see, besides its segment: static, hashable.

    Attributes:
      causal: keys at later positions are hidden.
      window: keys more than ``window - 1`` positions before the query are hidden (None: all).
      softcap: scores become ``softcap * tanh(score / softcap)`` (None: unchanged).
      scale: multiplies ``q . k``.
      kv_len: keys at and beyond this index are padding (None: none).
    """

    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    kv_len: int | None = None


def _tile_mask(mask: Mask, qpos, kpos, qseg, kseg):
    """``[B or 1, 1, 1, bq, bk]`` bool: which of a tile's scores count."""
    ok = jnp.ones((qpos.shape[0], kpos.shape[0]), bool)
    if mask.causal:
        ok &= qpos[:, None] >= kpos[None, :]
    if mask.window is not None:
        ok &= qpos[:, None] - kpos[None, :] < mask.window
    if mask.kv_len is not None:
        ok &= (kpos < mask.kv_len)[None, :]
    ok = ok[None, None, None]
    if qseg is not None:
        ok = ok & (qseg[:, :, None] == kseg[:, None, :])[:, None, None]
    return ok


def _scores(mask: Mask, qi, kj):
    """Scaled (and capped) scores of a tile ``[B, K, G, bq, bk]`` in float32, and the tanh of
    the cap (for the backward)."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    s = s * mask.scale
    if mask.softcap is None:
        return s, None
    t = jnp.tanh(s / mask.softcap)
    return mask.softcap * t, t


def _k_range(mask: Mask, i, bq: int, bk: int, nk: int, offset: int):
    """Key blocks ``[lo, hi)`` that query block ``i`` can see."""
    first, last = offset + i * bq, offset + i * bq + bq - 1  # positions of its rows
    hi = jnp.minimum(last // bk + 1, nk) if mask.causal else nk
    lo = jnp.maximum((first - mask.window + 1) // bk, 0) if mask.window is not None else 0
    return lo, hi


def _q_range(mask: Mask, j, bq: int, bk: int, nq: int, offset: int):
    """Query blocks ``[lo, hi)`` that see key block ``j``."""
    first, last = j * bk, j * bk + bk - 1
    lo = jnp.clip((first - offset) // bq, 0, nq) if mask.causal else 0
    if mask.window is None:
        return lo, nq
    return lo, jnp.clip((last + mask.window - 1 - offset) // bq + 1, 0, nq)


def _segs(seg, start, size):
    return None if seg is None else lax.dynamic_slice_in_dim(seg, start, size, axis=1)


def _forward(mask: Mask, bq: int, bk: int, q, k, v, qseg, kseg, offset=None, dtype=None):
    """``(out [B, T, K, G, D], lse [B, K, G, T])`` of grouped ``q [B, T, K, G, D]``, query
    ``i`` at key position ``offset + i`` (default ``S - T``; may be traced: ring attention's
    blocks); ``out`` in ``dtype`` (default ``q``'s). A row that sees no key gets out 0 and
    lse -inf."""
    b, t, kh, g, d = q.shape
    s_len = k.shape[1]
    nq, nk = t // bq, s_len // bk
    offset = s_len - t if offset is None else offset

    def q_block(i):
        qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
        qs = _segs(qseg, i * bq, bq)
        qpos = offset + i * bq + jnp.arange(bq)

        def k_block(j, carry):
            m, total, acc = carry
            kj = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
            vj = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
            s, _ = _scores(mask, qi, kj)
            s = jnp.where(_tile_mask(mask, qpos, j * bk + jnp.arange(bk), qs,
                                     _segs(kseg, j * bk, bk)), s, _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj,
                            preferred_element_type=jnp.float32)
            return m_new, total * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (jnp.full((b, kh, g, bq), _NEG, jnp.float32),
                jnp.zeros((b, kh, g, bq), jnp.float32),
                jnp.zeros((b, kh, g, bq, d), jnp.float32))
        lo, hi = _k_range(mask, i, bq, bk, nk, offset)
        m, total, acc = lax.fori_loop(lo, hi, k_block, init)
        seen = total > 0  # a block range left empty by the mask (ring attention's blocks)
        out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1)[..., None], 0)
        out = out.astype(dtype or q.dtype)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1)), -jnp.inf)
        return jnp.moveaxis(out, 3, 1), lse  # [B, bq, K, G, D]

    outs, lses = lax.map(q_block, jnp.arange(nq))  # [nq, B, bq, K, G, D], [nq, B, K, G, bq]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, t, kh, g, d)
    lse = jnp.moveaxis(lses, 0, 3).reshape(b, kh, g, t)
    return out, lse


def _grads(mask: Mask, bq: int, bk: int, res, dout, offset=None, dq=None):
    """float32 ``(dq, dk, dv)`` of one block pair, given the rows' final ``out`` and ``lse``
    (over every key the rows see, in this block or others: ring attention); ``dq``: a float32
    running sum to add this pair's query gradient to (ring attention: no second buffer)."""
    q, k, v, qseg, kseg, out, lse = res
    b, t, kh, _, d = q.shape
    s_len = k.shape[1]
    nq, nk = t // bq, s_len // bk
    offset = s_len - t if offset is None else offset
    # D_i = rowsum(dO * O): the softmax backward's correction, per query row
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32))

    def k_block(dq, j):
        kj = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
        ks = _segs(kseg, j * bk, bk)
        kpos = j * bk + jnp.arange(bk)

        def q_block(i, carry):
            dq, dk, dv = carry
            qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
            doi = lax.dynamic_slice_in_dim(dout, i * bq, bq, axis=1)
            lse_i = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            s, tanh = _scores(mask, qi, kj)
            ok = _tile_mask(mask, offset + i * bq + jnp.arange(bq), kpos,
                            _segs(qseg, i * bq, bq), ks)
            p = jnp.where(ok, jnp.exp(s - lse_i[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dout.dtype), doi,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None])
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds = (ds * mask.scale).astype(q.dtype)
            dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1) + dqi, i * bq, axis=1)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
            return dq, dk, dv

        zeros = jnp.zeros((b, bk, kh, d), jnp.float32)
        lo, hi = _q_range(mask, j, bq, bk, nq, offset)
        dq, dk, dv = lax.fori_loop(lo, hi, q_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = jnp.zeros(q.shape, jnp.float32) if dq is None else dq
    dq, (dks, dvs) = lax.scan(k_block, dq0, jnp.arange(nk))
    regroup = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, s_len, kh, d)
    return dq, regroup(dks), regroup(dvs)


def _backward(mask: Mask, bq: int, bk: int, res, dout):
    q, k, v = res[:3]
    dq, dk, dv = _grads(mask, bq, bk, res, dout)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _core(mask, bq, bk, q, k, v, qseg, kseg):
    return _forward(mask, bq, bk, q, k, v, qseg, kseg)[0]


def _core_fwd(mask, bq, bk, q, k, v, qseg, kseg):
    out, lse = _forward(mask, bq, bk, q, k, v, qseg, kseg)
    return out, (q, k, v, qseg, kseg, out, lse)


_core.defvjp(_core_fwd, _backward)


def _pad(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def blockwise_attention(q, k, v, segment_ids=None, *, causal: bool = True,
                        window: int | None = None, softcap: float | None = None,
                        scale: float, block_q: int = 512, block_k: int = 512) -> jax.Array:
    """Attention of ``q [B, T, H, D]`` over ``k``, ``v`` ``[B, S, K, D]``, never ``T x S``.

    Args:
      segment_ids: None, or ``(q_ids [B, T], kv_ids [B, S])``: a query sees only keys of its
        own segment (packed documents).
      block_q, block_k: tile sizes (clipped to the lengths; the lengths are padded to them).

    Returns:
      ``[B, T, H, D]`` in ``q``'s dtype.
    """
    b, t, h, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s_len)
    if t == s_len:  # self-attention: both padded alike, so query i stays at key i
        tp = sp = -(-t // math.lcm(bq, bk)) * math.lcm(bq, bk)
    elif t % bq or s_len % bk:
        raise ValueError(f"blockwise attention of {t} queries over {s_len} keys needs block "
                         f"sizes dividing both (got {bq}, {bk})")
    else:
        tp, sp = t, s_len
    mask = Mask(causal, window, softcap, float(scale), s_len if sp != s_len else None)
    qg = _pad(q.reshape(b, t, kh, h // kh, d), 1, tp)
    qseg = kseg = None
    if segment_ids is not None:  # padding rows and columns get segments of their own
        qseg = _pad(segment_ids[0].astype(jnp.int32), 1, tp, -1)
        kseg = _pad(segment_ids[1].astype(jnp.int32), 1, sp, -2)
    out = _core(mask, bq, bk, qg, _pad(k, 1, sp), _pad(v, 1, sp), qseg, kseg)
    return out[:, :t].reshape(b, t, h, d)
