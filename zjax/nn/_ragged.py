"""A ragged all-to-all: each device sends a different number of rows to each other device, and
only those rows travel (expert parallelism's dispatch and combine).

Rows go out packed by destination (``send[j]`` rows for device ``j``, in device order, from row
0) and arrive packed by source (``recv[i]`` rows from device ``i``, in device order, from row 0,
zeros after). Two ways, one result:

- ``ragged``: ``jax.lax.ragged_all_to_all`` (XLA's ``ragged-all-to-all``: what XLA:GPU and TPU
  compile). Its operand is the rows this device has to send and its output a buffer big
  enough for any arrival, so the HLO's smaller side is the bytes it can move.
- ``chunked``: for backends without it (XLA:CPU refuses the opcode): rounds of a fixed-size
  all-to-all, ``chunk`` rows per destination each, as many rounds as the largest slice needs
  (agreed over the axis). With the default chunk (an even share of the rows) a balanced
  routing takes one round, the operand's bytes; a skewed one a few more.

The move is linear; its gradient is the same move backwards (:func:`ragged_move`'s VJP), so
neither way is differentiated through (the chunked loop has a trip count known only at run
time).

XLA:CPU runs a loop's collectives in an executor of its own, unordered against any collective
outside the loop that no data dependency orders (every collective JAX emits has channel id 1:
two all-to-alls in flight at once share one rendezvous and crash or hang the step;
:func:`zjax.planning.unordered_collectives`). So chunked moves are put in sequence by data:
a move's gradient loop takes its round count from its forward's result too (``after``), and
:func:`~zjax.nn._dispatch.parallel_dropless` runs its pieces one after another. (An
optimization barrier tying a value to one it does not return would not do: XLA drops a
barrier's unused outputs, and the dependency with them.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._wire import all_to_all, varying_zeros

__all__ = ["EXCHANGES", "ragged_move"]

EXCHANGES = ("auto", "ragged", "chunked")


def _starts(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def _ragged(x, send, recv, rows: int, axis: str) -> jax.Array:
    out_starts = _starts(recv)  # where each source's rows land here
    # where this device's rows land on each destination: that destination's out_starts
    there = lax.all_to_all(out_starts, axis, 0, 0, tiled=True)
    out = jnp.zeros((rows, *x.shape[1:]), x.dtype)
    return lax.ragged_all_to_all(x, out, _starts(send), send, there, recv, axis_name=axis)


def _chunked(x, send, recv, rows: int, axis: str, chunk: int, after=None) -> jax.Array:
    d = x.shape[1:]
    lane = jnp.arange(chunk)
    rounds = jnp.max((send + chunk - 1) // chunk)
    if after is not None:  # the loop waits for ``after`` (a NaN there: one empty round more)
        rounds = jnp.maximum(rounds, jnp.isnan(after).astype(rounds.dtype))
    rounds = lax.pmax(rounds, axis)
    in_starts, out_starts = _starts(send), _starts(recv)

    def one_round(r, y):
        at = r * chunk + lane  # [chunk]: this round's row of each slice
        src = jnp.where(at < send[:, None], in_starts[:, None] + at, x.shape[0])  # [n, chunk]
        buf = jnp.take(x, src.reshape(-1), axis=0, mode="fill", fill_value=0)
        got = all_to_all(buf, axis, 0, 0)  # [sources x chunk, ...]
        dst = jnp.where(at < recv[:, None], out_starts[:, None] + at, rows)
        return y.at[dst.reshape(-1)].set(got, mode="drop", unique_indices=True)

    init = varying_zeros((rows, *d), x.dtype, x, axes=(axis,))
    return lax.fori_loop(0, rounds, one_round, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def ragged_move(x: jax.Array, send: jax.Array, recv: jax.Array, rows: int, axis: str,
                how: str, chunk: int) -> jax.Array:
    """Rows of ``x`` to the devices of ``axis`` (inside ``shard_map``).

    Args:
      x: ``[M, ...]``: ``send[0]`` rows for device 0, then ``send[1]`` for device 1, ...
        (rows past ``sum(send)`` are not sent).
      send: ``[n]`` int32 rows for each device of the axis.
      recv: ``[n]`` int32 rows from each device: ``all_to_all(send)`` (the caller has them).
      rows: the output's rows, at least ``sum(recv)`` (which static shapes bound by
        ``n x M``).
      axis: the mesh axis.
      how: ``ragged`` or ``chunked`` (module docstring).
      chunk: rows per destination a ``chunked`` round moves.

    Returns:
      ``[rows, ...]``: ``recv[0]`` rows from device 0, then device 1's, ..., then zeros.
    """
    if how == "ragged":
        return _ragged(x, send, recv, rows, axis)
    return _chunked(x, send, recv, rows, axis, chunk)


def _move_fwd(x, send, recv, rows, axis, how, chunk):
    out = ragged_move(x, send, recv, rows, axis, how, chunk)
    # a chunked move's gradient loop must not run while its forward loop does (module doc)
    done = out[(0,) * out.ndim] if how == "chunked" else None
    return out, (send, recv, x.shape[0], done)


def _move_bwd(rows, axis, how, chunk, res, g):
    send, recv, m, done = res
    if done is not None:  # chunked: not while the forward's loop (recomputed) may still run
        return _chunked(g, recv, send, m, axis, chunk, after=done), None, None
    # each arrived row's gradient goes back to where it came from; the padding's is dropped
    return ragged_move(g, recv, send, m, axis, how, chunk), None, None


ragged_move.defvjp(_move_fwd, _move_bwd)
