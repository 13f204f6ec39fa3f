"""Attention over a sequence split along a mesh axis (context parallelism), inside
``shard_map``: each device holds ``T / C`` consecutive tokens (or, striped, two chunks).

- :func:`ulysses_attention` (DeepSpeed-Ulysses): an all-to-all turns the sequence-split
  ``q``, ``k``, ``v`` into head-split full-length ones, :func:`zjax.nn.attention.attention`
  runs on them (any kernel), and an all-to-all turns the output back. Per layer and device
  the forward moves ``q``, ``k``, ``v`` and the output once each: ``(C - 1) / C`` of
  ``4 x T/C x d_model`` elements with as many key/value as query heads. The query heads must
  divide by ``C``; so must the key/value heads, or ``C`` by them, and then each key/value
  head is repeated to ``C`` (grouped-query attention with few key/value heads: those bytes
  grow to the query heads').
- :func:`ring_attention`: key/value blocks passed around the axis with an online softmax
  (:mod:`zjax.nn._ring`); any head count; memory linear in the local length. Causal
  attention is balanced with :func:`stripe`'s layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zjax.errors import ArgumentError
from zjax.nn._attend import local_attention
from zjax.nn._blockwise import Mask
from zjax.nn._ring import ring
from zjax.nn._wire import all_to_all

__all__ = ["CONTEXT_METHODS", "context_attention", "context_method", "ring_attention", "stripe",
           "stripe_shard", "ulysses_attention", "ulysses_kv_repeat", "unstripe"]


def ulysses_kv_repeat(kv_heads: int, n: int) -> int:
    """How many times Ulysses repeats each of ``kv_heads`` key/value heads over ``n``
    devices: 1 when ``n`` divides them, ``n / kv_heads`` when they divide ``n``.

    Raises:
      ArgumentError: neither divides the other.
    """
    if kv_heads % n == 0:
        return 1
    if n % kv_heads == 0:
        return n // kv_heads
    raise ArgumentError("mesh.context", f"{kv_heads} key/value heads and a context axis of "
                        f"{n} do not divide one another (Ulysses splits the heads over the "
                        "axis); use ring attention")


def ulysses_attention(q, k, v, *, axis_name: str, segment_ids=None, striped: bool = False,
                      **options) -> jax.Array:
    """Attention of the local ``q [B, T/C, H, D]`` over ``k``, ``v`` ``[B, T/C, K, D]``,
    the sequence split over ``axis_name`` (``C`` devices, consecutive blocks), by all-to-all.

    Args:
      axis_name: the mesh axis the sequence is split over (inside ``shard_map``).
      segment_ids: None or ``[B, T/C]`` ints (packed documents), gathered over the axis.
      striped: the local tokens are :func:`stripe`'s layout (chunks ``i`` and ``2C - 1 - i``);
        the full-length sequences are put back in order around the attention.
      **options: :func:`zjax.nn.attention.attention`'s (causal, window, softcap, scale,
        implementation, block_size).

    Returns:
      The local ``[B, T/C, H, D]`` of the output.
    """
    n = lax.axis_size(axis_name)
    if q.shape[2] % n:
        raise ArgumentError("mesh.context", f"{q.shape[2]} query heads do not divide by a "
                            f"context axis of {n} (Ulysses splits the heads over it); use "
                            "ring attention")
    repeat = ulysses_kv_repeat(k.shape[2], n)
    if repeat > 1:  # query head h reads key/value head h // (H / K) still
        k, v = (jnp.repeat(x, repeat, axis=2) for x in (k, v))
    order = (lambda x: unstripe(x, n)) if striped else (lambda x: x)
    to_heads = lambda x: order(all_to_all(x, axis_name, 2, 1))
    if segment_ids is not None:
        segment_ids = order(lax.all_gather(segment_ids, axis_name, axis=1, tiled=True))
    out = local_attention(to_heads(q), to_heads(k), to_heads(v), segment_ids=segment_ids,
                          **options)
    if striped:
        out = stripe(out, n)
    return all_to_all(out, axis_name, 1, 2)


def ring_attention(q, k, v, *, axis_name: str, segment_ids=None, causal: bool = True,
                   window: int | None = None, softcap: float | None = None,
                   scale: float | None = None, striped: bool = True,
                   block_size: int = 512) -> jax.Array:
    """Self-attention of the local ``q [B, T/C, H, D]`` over ``k``, ``v`` ``[B, T/C, K, D]``,
    the sequence split over ``axis_name`` (inside ``shard_map``), by passing key/value
    blocks around it.

    Args:
      axis_name: the mesh axis the sequence is split over.
      segment_ids: None or the local ``[B, T/C]`` ints (packed documents).
      causal, window, softcap, scale: as :func:`zjax.nn.attention.attention`'s.
      striped: the local tokens are chunks ``i`` and ``2C - 1 - i`` of ``2C``
        (:func:`stripe`); else the ``i``-th of ``C`` consecutive blocks.
      block_size: the tile of each block pair (must divide a chunk, or be clipped to it).

    Returns:
      The local ``[B, T/C, H, D]`` of the output, in the same layout.
    """
    b, t, h, d = q.shape
    kh = k.shape[2]
    if h % kh or k.shape != v.shape or k.shape[:2] != q.shape[:2]:
        raise ArgumentError("attention", f"ring attention needs q [B, T, H, D] and k, v "
                            f"[B, T, K, D] with K dividing H; got {q.shape}, {k.shape}")
    chunk = t // 2 if striped else t
    block = min(block_size, chunk)
    if (striped and t % 2) or chunk % block:
        raise ArgumentError("attention", f"ring attention's local length {t} must split into "
                            f"{2 if striped else 1} chunk(s) of a multiple of the block "
                            f"{block}")
    mask = Mask(causal, window, softcap, float(scale if scale is not None
                                               else 1 / math.sqrt(d)))
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    out = ring(mask, block, block, axis_name, striped, q.reshape(b, t, kh, h // kh, d), k, v,
               seg, seg)
    return out.reshape(b, t, h, d)


CONTEXT_METHODS = ("auto", "ulysses", "ring")


def context_method(method: str, *, q_heads: int, kv_heads: int, n: int) -> str:
    """``ulysses`` or ``ring``: what ``method`` (one of :data:`CONTEXT_METHODS`) runs for
    ``q_heads`` and ``kv_heads`` local heads over a context axis of ``n``. ``auto`` takes
    Ulysses where the heads split over the axis (its all-to-alls move each activation once,
    and the attention runs in the backend's fastest kernel), else the ring.

    Raises:
      ArgumentError: an unknown method, or Ulysses asked for heads it cannot split.
    """
    if method not in CONTEXT_METHODS:
        raise ArgumentError("model.context_attention", f"{method!r} is not a context "
                            f"attention; choose one of {', '.join(CONTEXT_METHODS)}")
    fits = q_heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
    if method == "ulysses" and not fits:
        raise ArgumentError("model.context_attention", f"ulysses splits the {q_heads} query "
                            f"and {kv_heads} key/value heads (per model-axis device) over "
                            f"mesh.context {n}, which does not divide the query heads or "
                            "divide / is divided by the key/value heads; use ring or auto")
    return method if method != "auto" else "ulysses" if fits else "ring"


def context_attention(q, k, v, *, axis_name: str, method: str = "auto", segment_ids=None,
                      implementation: str = "auto", block_size: int = 512, causal: bool = True,
                      window: int | None = None, softcap: float | None = None,
                      scale: float | None = None) -> jax.Array:
    """Self-attention of the local ``q``, ``k``, ``v`` of a sequence split over ``axis_name``
    in :func:`stripe`'s layout (what a zjax step gives each device), by Ulysses or the ring
    (:func:`context_method`). ``implementation`` is the kernel Ulysses runs (the ring runs
    its own blockwise one)."""
    n = lax.axis_size(axis_name)
    how = context_method(method, q_heads=q.shape[2], kv_heads=k.shape[2], n=n)
    mask = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    if how == "ulysses":
        return ulysses_attention(q, k, v, axis_name=axis_name, segment_ids=segment_ids,
                                 striped=True, implementation=implementation,
                                 block_size=block_size, **mask)
    # a tile dividing the local chunks (T / 2C), at most half of one: a loop of one tile is
    # inlined, and the compiler may then keep several block pairs' tiles alive at once
    # (measured: 3x the unsplit step's temp on XLA:CPU with one tile a chunk, 0.94x with two)
    chunk = q.shape[1] // 2
    block = math.gcd(chunk, block_size)
    if block == chunk and chunk % 2 == 0:
        block //= 2
    return ring_attention(q, k, v, axis_name=axis_name, segment_ids=segment_ids, striped=True,
                          block_size=block, **mask)


def _stripe_order(n: int) -> np.ndarray:
    return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)])


def stripe(x, n: int, *, axis: int = 1):
    """The global sequence ``x`` reordered so that ``n`` equal consecutive blocks of it are
    the striped layout: block ``i`` holds chunks ``i`` and ``2n - 1 - i`` of ``2n``."""
    if x.shape[axis] % (2 * n):
        raise ArgumentError("mesh.context", f"a sequence of {x.shape[axis]} tokens does not "
                            f"split into 2 x {n} equal chunks (ring attention's striping); use "
                            f"a sequence length (data.seq_len) divisible by {2 * n}")
    chunks = jnp.split(x, 2 * n, axis=axis)
    return jnp.concatenate([chunks[c] for c in _stripe_order(n)], axis=axis)


def unstripe(x, n: int, *, axis: int = 1):
    """:func:`stripe`'s inverse."""
    chunks = jnp.split(x, 2 * n, axis=axis)
    inverse = np.argsort(_stripe_order(n))
    return jnp.concatenate([chunks[c] for c in inverse], axis=axis)


def stripe_shard(x, *, axis_name: str, axis: int = 1):
    """This device's block of :func:`stripe` ``(x, C)`` (inside ``shard_map``, ``C`` the size
    of ``axis_name``): chunks ``i`` and ``2C - 1 - i`` of the ``2C`` equal chunks of the
    global ``x`` along ``axis``, ``i`` the device's index on the axis.

    Raises:
      ArgumentError: ``2C`` does not divide the length.
    """
    n = lax.axis_size(axis_name)
    t = x.shape[axis]
    if t % (2 * n):
        raise ArgumentError("mesh.context", f"a context axis of {n} does not split a sequence "
                            f"of {t} tokens into 2 x {n} equal chunks (each device holds chunks "
                            f"i and {2 * n - 1} - i, balancing causal attention); use a sequence "
                            f"length (data.seq_len) divisible by {2 * n}")
    chunk, i = t // (2 * n), lax.axis_index(axis_name)
    take = lambda c: lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=axis)
    return jnp.concatenate([take(i), take(2 * n - 1 - i)], axis=axis)
