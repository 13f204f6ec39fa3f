"""Checksums of checkpointed arrays that do not depend on how an array is sharded.

Orbax's array files carry no checksum of their data: a flipped bit in a chunk reads back as a
wrong value. So each checkpoint records, per leaf, a 64-bit digest of the whole (global) array,
and a restore or an export recomputes it. The digest is two wrapping uint32 sums over the
array's 32-bit words ``w[i]``: ``sum(fmix(w[i] ^ p1(i)))`` and ``sum(fmix(w[i] + p2(i)))``
mod 2**32, where ``fmix`` is murmur3's 32-bit finaliser (a bijection that spreads every input
bit over the output) and ``p1``, ``p2`` hash the global position. Sums commute, so the value is
the same whether the array is computed on 8 shards, on 1 device, or in numpy; because each term
is a pseudo-random function of (value, position), changed words cancel out only by chance
(about 2**-64 for both sums), whatever the pattern of the change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["array_digest", "leaf_name", "recorded_digests", "tree_digests"]

_SEED1, _SEED2 = 0x9E3779B1, 0x7F4A7C15  # golden ratio, and another odd constant


def _words_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    size = x.dtype.itemsize
    if size == 8:
        return x.view(np.uint32).reshape(*x.shape, 2)
    unsigned = {4: np.uint32, 2: np.uint16, 1: np.uint8}[size]
    return x.view(unsigned).astype(np.uint32)


def _words_jnp(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fmix(h, xp):
    """murmur3's finaliser: every input bit affects every output bit."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def _mix(words, index, xp) -> tuple:
    p1 = _fmix(index ^ xp.uint32(_SEED1), xp)
    p2 = _fmix(index + xp.uint32(_SEED2), xp)
    return (xp.sum(_fmix(words ^ p1, xp), dtype=xp.uint32),
            xp.sum(_fmix(words + p2, xp), dtype=xp.uint32))


def _format(h1, h2) -> str:
    return f"{int(h1):08x}{int(h2):08x}"


def array_digest(x: np.ndarray, *, chunk: int = 1 << 20) -> str:
    """The digest of a host (numpy) array: 16 hex digits.

    Computed ``chunk`` elements at a time (the sums are mod 2**32, so they add up across
    chunks): the temporaries stay a few MiB whatever the leaf's size, which keeps an export's
    peak near its largest leaf.
    """
    flat = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    per = 2 if flat.dtype.itemsize == 8 else 1  # 32-bit words per element
    h1 = h2 = 0
    with np.errstate(over="ignore"):
        for start in range(0, flat.size, chunk):
            words = _words_np(flat[start:start + chunk]).reshape(-1)
            first = start * per  # the words' flat row-major positions, wrapping like uint32
            index = (np.arange(first, first + words.size, dtype=np.uint64)
                     & 0xFFFFFFFF).astype(np.uint32)
            a, b = _mix(words, index, np)
            h1, h2 = (h1 + int(a)) & 0xFFFFFFFF, (h2 + int(b)) & 0xFFFFFFFF
    return _format(h1, h2)


@jax.jit
def _device_digest(x: jax.Array) -> jax.Array:
    from zjax.offload import to_device  # a leaf offloaded to host memory is read on the device

    words = _words_jnp(to_device(x))
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(words.ndim)):  # the flat row-major position, wrapping like numpy
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(
            stride & 0xFFFFFFFF)
        stride *= words.shape[d]
    return jnp.stack(_mix(words, index, jnp))


def leaf_name(path) -> str:
    """A tree path as ``a/0/b`` whatever its nodes are (dicts, tuples, NamedTuples): the one
    naming of checkpointed arrays (Orbax's metadata stores NamedTuples as dicts)."""
    parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(map(str, parts))


def tree_digests(tree: Any) -> dict[str, str]:
    """``{leaf_name(path): digest}`` of every array leaf of ``tree`` (sharded or not).

    Leaves are digested one at a time (an offloaded leaf visits the device one at a time), and
    the small results are fetched together.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    pending = [(leaf_name(p), _device_digest(x)) for p, x in flat]
    values = jax.device_get([v for _, v in pending])
    return {k: _format(*v) for (k, _), v in zip(pending, values, strict=True)}


def recorded_digests(step_dir: Path) -> dict[str, str] | None:
    """The array digests a zjax checkpoint recorded (its ``meta`` item), or None if it has none.

    Keys are :func:`leaf_name` paths of the canonical tree (``params/blocks/w``).

    Raises:
      OSError, ValueError: the ``meta`` item exists but cannot be read as JSON.
    """
    path = Path(step_dir) / "meta" / "metadata"
    if not path.exists():
        return None
    return (json.loads(path.read_text()).get("digests") or {}).get("state")
