"""Expert parallelism: each device holds ``E / n`` of the experts (the ``expert`` axis splits
them), and token-expert assignments travel to the device holding their expert and back by
all-to-all over that axis (inside ``shard_map``). Expert ``e`` lives on device ``e // (E / n)``.

- With a capacity (GShard): the ``[E, capacity, D]`` buffers are already grouped by device:
  one all-to-all of ``E x capacity x D`` each way, ``(n - 1) / n`` of it leaving the device.
- Dropless: the assignments, sorted by expert, go into one buffer per destination device big
  enough for every assignment (an all-to-all needs static shapes, and XLA:CPU has no
  ``ragged-all-to-all``): ``n x N x k x D`` each way; the receiver sorts what arrived by its
  local expert and runs its grouped matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._experts import Experts, batched, combine, grouped, with_capacity
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
                      activation: Callable, matmul: str = "auto") -> jax.Array:
    """Every assignment computed on the device holding its expert."""
    n_tok, d = x.shape
    k = routing.experts.shape[1]
    n, local = lax.axis_size(axis), w.gate.shape[0]
    rows = n_tok * k  # what one destination may receive from this device, at most
    flat = routing.experts.reshape(-1)  # assignment t * k + j
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n * local).astype(jnp.int32)
    dest = flat[order] // local  # sorted by expert, so by destination
    per_dest = sizes.reshape(n, local).sum(axis=1)
    slot = jnp.arange(rows) - (jnp.cumsum(per_dest) - per_dest)[dest]
    send = jnp.zeros((n, rows, d), x.dtype).at[dest, slot].set(
        jnp.take(x, order // k, axis=0), unique_indices=True)
    got = all_to_all(send.reshape(n * rows, d), axis, 0, 0)  # [sources x rows, D]
    got_sizes = lax.all_to_all(sizes.reshape(n, local), axis, 0, 0, tiled=True)
    # each source's rows arrive sorted by local expert, then padding: sort them all by expert
    bounds = jnp.cumsum(got_sizes, axis=1)  # [sources, local]
    expert = jax.vmap(lambda b: jnp.searchsorted(b, jnp.arange(rows), side="right"))(bounds)
    by_expert = jnp.argsort(expert.reshape(-1), stable=True)  # padding (= local) last
    ys = grouped(jnp.take(got, by_expert, axis=0), w, jnp.sum(got_sizes, axis=0), activation,
                 matmul=matmul)
    back = jnp.zeros_like(ys).at[by_expert].set(ys, unique_indices=True)
    mine = all_to_all(back, axis, 0, 0).reshape(n, rows, d)  # [destinations, rows, D]
    y = jnp.zeros((rows, d), x.dtype).at[order].set(mine[dest, slot], unique_indices=True)
    return combine(y.reshape(n_tok, k, d), routing.weights, x.dtype)
