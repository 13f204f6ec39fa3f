"""Expert parallelism: each device holds ``E / n`` of the experts (the ``expert`` axis splits
them), and token-expert assignments travel to the device holding their expert and back by
all-to-all over that axis (inside ``shard_map``). Expert ``e`` lives on device ``e // (E / n)``.

- With a capacity (GShard): the ``[E, capacity, D]`` buffers are already grouped by device:
  one all-to-all of ``E x capacity x D`` each way, ``(n - 1) / n`` of it leaving the device.
- Dropless: the assignments, sorted by expert (so by destination), travel by a ragged
  all-to-all (:mod:`zjax.nn._ragged`): ``N x k x D`` leave each way, the rows actually routed.
  The receiver's buffer holds the worst case (``n x N x min(k, E / n)`` rows: every device
  may send all its tokens, each to at most ``min(k, E / n)`` of this device's experts); it
  puts what arrived in order of its local experts (arithmetic, no sort) and runs its grouped
  matmuls, whose tiles past the arrivals are skipped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._attend import trace_platform
from zjax.nn._experts import Experts, batched, combine, grouped, with_capacity
from zjax.nn._ragged import EXCHANGES, ragged_move
from zjax.nn._routing import Routing
from zjax.nn._wire import all_to_all

__all__ = ["parallel_capacity", "parallel_dropless"]


def parallel_capacity(x: jax.Array, routing: Routing, w: Experts, *, axis: str,
                      factor: float, activation: Callable) -> tuple[jax.Array, jax.Array]:
    """:func:`~zjax.nn._experts.with_capacity` with this device's ``w`` (its experts) and the
    buffers of every expert exchanged over ``axis``."""
    n, local = lax.axis_size(axis), w.gate.shape[0]

    def experts_fn(buf):  # [E, C, D] -> the experts' outputs, the same layout
        e, c, d = buf.shape
        mine = all_to_all(buf.reshape(e * c, d), axis, 0, 0)  # [sources x local x C, D]
        mine = mine.reshape(n, local, c, d).swapaxes(0, 1).reshape(local, n * c, d)
        out = batched(mine, w, activation)
        out = out.reshape(local, n, c, d).swapaxes(0, 1).reshape(e * c, d)
        return all_to_all(out, axis, 0, 0).reshape(e, c, d)

    return with_capacity(x, routing, w, factor=factor, activation=activation,
                         experts_fn=experts_fn)


def parallel_dropless(x: jax.Array, routing: Routing, w: Experts, *, axis: str,
                      activation: Callable, matmul: str = "auto", exchange: str = "auto",
                      pieces: int = 1) -> jax.Array:
    """Every assignment computed on the device holding its expert; only the routed rows travel
    (:func:`~zjax.nn._ragged.ragged_move`, ``exchange``: ``ragged``, ``chunked`` or ``auto``,
    ``chunked`` on XLA:CPU and ``ragged`` elsewhere).

    ``pieces`` > 1 splits the tokens into that many independent exchanges (each dispatched,
    computed and combined on its own), so the compiler can run one piece's all-to-all while
    another's experts compute; the bytes are the same. Fewer tokens than that divide into
    (the greatest common divisor: a decode step's)."""
    pieces = math.gcd(pieces, x.shape[0])  # a decode step's few tokens: fewer pieces
    how = _exchange(exchange)
    if pieces > 1:
        def piece(part):
            return parallel_dropless(part[0], routing._replace(weights=part[1], experts=part[2]),
                                     w, axis=axis, activation=activation, matmul=matmul,
                                     exchange=how)

        parts = tuple(a.reshape(pieces, -1, *a.shape[1:])
                      for a in (x, routing.weights, routing.experts))
        if how == "chunked":  # the chunked loops one piece after another, backward too
            return lax.map(piece, parts).reshape(x.shape)  # (_ragged's module doc)
        return jnp.concatenate([piece(tuple(a[i] for a in parts)) for i in range(pieces)])
    n_tok, d = x.shape
    k = routing.experts.shape[1]
    n, local = lax.axis_size(axis), w.gate.shape[0]
    rows = n_tok * k
    flat = routing.experts.reshape(-1)  # assignment t * k + j
    order = jnp.argsort(flat, stable=True)  # by expert, so by destination
    sizes = jnp.bincount(flat, length=n * local).astype(jnp.int32).reshape(n, local)
    got_sizes = lax.all_to_all(sizes, axis, 0, 0, tiled=True)  # [sources, local]
    send, recv = jnp.sum(sizes, axis=1), jnp.sum(got_sizes, axis=1)
    chunk = -(-rows // n)  # an even share: a balanced routing moves in one chunked round
    move = functools.partial(ragged_move, axis=axis, how=how, chunk=chunk)
    # what may land here (a buffer, not traffic): a token's k experts are distinct, so it
    # sends a device at most min(k, local) rows, and every device may send all its tokens
    bound = n * n_tok * min(k, local)
    got = move(jnp.take(x, order // k, axis=0), send, recv, bound)
    place = _by_expert(got_sizes, bound)
    mine = jnp.zeros_like(got).at[place].set(got, unique_indices=True)
    ys = grouped(mine, w, jnp.sum(got_sizes, axis=0), activation, matmul=matmul)
    back = move(jnp.take(ys, place, axis=0), recv, send, rows)  # sorted by expert again
    y = jnp.zeros((rows, d), x.dtype).at[order].set(back, unique_indices=True)
    return combine(y.reshape(n_tok, k, d), routing.weights, x.dtype)


def _exchange(exchange: str) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: {exchange!r}; expected one of {', '.join(EXCHANGES)}")
    if exchange == "auto":  # XLA:CPU has no ragged-all-to-all
        return "chunked" if trace_platform() == "cpu" else "ragged"
    return exchange


def _by_expert(got_sizes: jax.Array, rows: int) -> jax.Array:
    """Each arrived row's place when sorted by local expert (source order within), arrived
    rows packed by source and by expert within: block ``(source, e)`` goes to block
    ``(e, source)``. A padding row keeps its place (past every arrival)."""
    n, local = got_sizes.shape
    p = jnp.arange(rows)
    ends = jnp.cumsum(got_sizes.reshape(-1))  # blocks in (source, expert) order
    block = jnp.searchsorted(ends, p, side="right")  # n x local: padding
    live = block < n * local
    b = jnp.minimum(block, n * local - 1)
    moved = got_sizes.T.reshape(-1)  # the same blocks in (expert, source) order
    moved_starts = (jnp.cumsum(moved) - moved).reshape(local, n).T.reshape(-1)
    return jnp.where(live, moved_starts[b] + p - (ends - got_sizes.reshape(-1))[b], p)
