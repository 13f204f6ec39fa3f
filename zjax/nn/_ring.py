"""Ring attention: the sequence split over a mesh axis, key/value blocks passed around it.

Each of the ``C`` devices of the axis holds ``T / C`` queries, keys and values. Over ``C``
steps every device attends its queries to the key/value block it holds, then hands that block
to the next device (``ppermute`` ``i -> i + 1``), so the blocks visit every device; the
partial results are merged by their log-sum-exp (the online softmax across devices). The
backward goes around the ring again with each block's key/value gradients travelling with it,
and one last hop brings them home. Per layer and device that moves ``(C - 1) / C`` of the
keys and values forward, and ``(C - 1) / C`` of them plus all of their gradients backward.

Each block pair runs :mod:`zjax.nn._blockwise`'s tiles at a traced position offset, so the
memory is linear in the local length and hidden tiles are skipped. Causal attention is
balanced by striping: with ``striped``, device ``i`` holds chunks ``i`` and ``2C - 1 - i`` of
the ``2C`` chunks of the sequence (:func:`zjax.nn.context.stripe`), so every device has as
many visible keys as any other at every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._blockwise import Mask, _forward, _grads
from zjax.nn._wire import ppermute

__all__ = ["ring"]


def _chunks(x, n: int, axis: int) -> list:
    if x is None:
        return [None] * n
    c = x.shape[axis] // n
    return [lax.slice_in_dim(x, a * c, (a + 1) * c, axis=axis) for a in range(n)]


def _starts(device, n: int, c: int, striped: bool) -> list:
    """Global positions of the first token of each local chunk of ``device``."""
    return [device * c, (2 * n - 1 - device) * c] if striped else [device * c]


def _pass(tree, axis: str, n: int):
    """Every device's ``tree`` to the next device of the ring."""
    perm = [(j, (j + 1) % n) for j in range(n)]
    return jax.tree.map(lambda x: ppermute(x, axis, perm), tree)


def _merge(acc, part):
    """Two partial attentions of the same rows merged by their log-sum-exps."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    finite = jnp.isfinite(lse)
    w1 = jnp.where(finite, jnp.exp(l1 - jnp.where(finite, lse, 0)), 0)
    w2 = jnp.where(finite, jnp.exp(l2 - jnp.where(finite, lse, 0)), 0)
    to_out = lambda w: jnp.moveaxis(w, 3, 1)[..., None]  # [B, K, G, T] -> [B, T, K, G, 1]
    return o1 * to_out(w1) + o2 * to_out(w2), lse


def _around(n: int, body, carry):
    """``body(carry, step, last)`` for ``step`` 0..n-1: a loop over all but the last step (a
    loop of unrolled steps would let the compiler keep every step's tiles alive at once, and
    blocks of one tile each have loops of one trip that it inlines), then the last one, which
    passes nothing on."""
    if n > 1:
        carry, _ = lax.scan(lambda c, step: (body(c, step, False), None), carry,
                            jnp.arange(n - 1))
    return body(carry, n - 1, True)


def _forward_ring(mask: Mask, bq: int, bk: int, axis: str, striped: bool, q, k, v, qseg,
                  kseg):
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    nc = 2 if striped else 1
    c = q.shape[1] // nc
    qs, qsegs = _chunks(q, nc, 1), _chunks(qseg, nc, 1)
    q_at = _starts(me, n, c, striped)
    b, _, kh, g, d = q.shape
    acc = [(jnp.zeros((b, c, kh, g, d), jnp.float32),
            jnp.full((b, kh, g, c), -jnp.inf, jnp.float32)) for _ in range(nc)]

    def step_fn(carry, step, last: bool):
        acc, block = carry
        nxt = block if last else _pass(block, axis, n)  # in flight while this block is used
        kvs = list(zip(*(_chunks(x, nc, 1) for x in block), strict=True))
        k_at = _starts((me - step) % n, n, c, striped)
        acc = list(acc)
        for a in range(nc):
            for j, (kc, vc, ksc) in enumerate(kvs):
                part = _forward(mask, bq, bk, qs[a], kc, vc, qsegs[a], ksc,
                                offset=q_at[a] - k_at[j], dtype=jnp.float32)
                acc[a] = _merge(acc[a], part)
        return acc, nxt

    acc, _ = _around(n, step_fn, (acc, (k, v, kseg)))
    out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
    return out, jnp.concatenate([lse for _, lse in acc], axis=3)


def _backward_ring(mask: Mask, bq: int, bk: int, axis: str, striped: bool, res, dout):
    q, k, v, qseg, kseg, out, lse = res
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    nc = 2 if striped else 1
    c = q.shape[1] // nc
    qs, qsegs, outs = _chunks(q, nc, 1), _chunks(qseg, nc, 1), _chunks(out, nc, 1)
    douts, lses = _chunks(dout, nc, 1), _chunks(lse, nc, 3)
    q_at = _starts(me, n, c, striped)

    def step_fn(carry, step, last: bool):
        dq, (kb, vb, ksb), (dk, dv) = carry
        nxt = (kb, vb, ksb) if last else _pass((kb, vb, ksb), axis, n)  # in flight meanwhile
        kvs = list(zip(*(_chunks(x, nc, 1) for x in (kb, vb, ksb)), strict=True))
        k_at = _starts((me - step) % n, n, c, striped)
        dq, dks, dvs = list(dq), _chunks(dk, nc, 1), _chunks(dv, nc, 1)
        for a in range(nc):
            for j, (kc, vc, ksc) in enumerate(kvs):
                dq[a], gk, gv = _grads(mask, bq, bk,
                                       (qs[a], kc, vc, qsegs[a], ksc, outs[a], lses[a]),
                                       douts[a], offset=q_at[a] - k_at[j], dq=dq[a])
                dks[j], dvs[j] = dks[j] + gk, dvs[j] + gv
        # the block's gradients travel with it; after the last step, one hop brings them home
        grads = _pass((jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)), axis, n)
        return dq, nxt, grads

    zeros = jnp.zeros(k.shape, jnp.float32)
    dq, _, (dk, dv) = _around(n, step_fn, ([jnp.zeros(x.shape, jnp.float32) for x in qs],
                                          (k, v, kseg), (zeros, zeros)))
    return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype),
            dv.astype(v.dtype), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def ring(mask: Mask, bq: int, bk: int, axis: str, striped: bool, q, k, v, qseg, kseg):
    """Grouped ``q [B, T, K, G, D]`` over ``k``, ``v`` ``[B, T, K, D]``, all local blocks of
    a sequence split over ``axis`` (striped or contiguous); segment ids ``[B, T]`` or None."""
    return _forward_ring(mask, bq, bk, axis, striped, q, k, v, qseg, kseg)[0]


def _ring_fwd(mask, bq, bk, axis, striped, q, k, v, qseg, kseg):
    out, lse = _forward_ring(mask, bq, bk, axis, striped, q, k, v, qseg, kseg)
    return out, (q, k, v, qseg, kseg, out, lse)


ring.defvjp(_ring_fwd, _backward_ring)
