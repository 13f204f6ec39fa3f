"""Grouped matmuls for dropless experts without a dense expansion: rows sorted by expert,
each expert's rows padded to whole tiles, one tile at a time through its expert's gated MLP.

``lax.ragged_dot`` is native on TPU, but XLA:CPU and XLA:GPU lower it through a dense expansion
(each row against every expert: the issue's measurement, 596 MB of temp on XLA:CPU and 252 MB
for the H100 target against 185 MB for the output). :func:`tiled_mlp` does the same sums with
``E`` tiles of padding at most: a loop over the tiles that hold rows (a buffer sized for the
worst case costs no compute past them), each a ``[tile, D] x [D, F]``
matmul against its expert's weights (a dynamic index, no copy of the stack), and a backward
of its own (:func:`jax.custom_vjp`: the hidden activations recomputed per tile, the weight
gradients summed in float32 over each expert's run of tiles and written into its slot once), so
neither pass holds more than one tile's ``[tile, F]`` activations and one expert's float32
gradient sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._wire import varying_zeros

__all__ = ["GROUPED_MATMULS", "tile_layout", "tiled_mlp"]

GROUPED_MATMULS = ("auto", "ragged_dot", "tiled")


def tile_layout(sizes: jax.Array, rows: int, tile: int) -> tuple[jax.Array, jax.Array, int]:
    """Where each of ``rows`` sorted rows goes in the tiled buffer.

    Args:
      sizes: ``[E]`` rows of each expert, in order (their sum at most ``rows``; the rows past
        it are padding and go nowhere).
      rows: the rows.
      tile: rows per tile.

    Returns:
      ``(dest [rows], tile_expert [T], T)``: each row's place (``T * tile``, past the end, for
      padding), each tile's expert, and the tiles: ``rows // tile + E`` bounds every layout.
    """
    n_experts = sizes.shape[0]
    n_tiles = rows // tile + n_experts
    ends = jnp.cumsum(sizes)
    padded = (sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    row = jnp.arange(rows)
    expert = jnp.searchsorted(ends, row, side="right")  # E for a padding row
    e = jnp.minimum(expert, n_experts - 1)
    dest = jnp.where(expert < n_experts,
                     (padded_ends - padded)[e] + row - (ends - sizes)[e], n_tiles * tile)
    tile_expert = jnp.searchsorted(padded_ends, jnp.arange(n_tiles) * tile, side="right")
    return dest, jnp.minimum(tile_expert, n_experts - 1).astype(jnp.int32), n_tiles


def tiled_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
              sizes: jax.Array, *, activation: Callable, tile: int = 256) -> jax.Array:
    """Rows of ``x`` sorted by expert (``sizes[e]`` rows for expert ``e``, then padding rows)
    through their experts' gated MLP, ``act(x G) * (x U) D``, tile by tile.

    Args:
      x: ``[M, D]`` rows.
      gate, up: ``[E, D, F]``; down: ``[E, F, D]``.
      sizes: ``[E]`` int rows per expert.
      activation: the gate's activation.
      tile: rows per tile (fewer for few rows: at most the next power of two of ``M / E``).

    Returns:
      ``[M, D]`` in ``x``'s dtype; zeros for the padding rows.
    """
    rows, d = x.shape
    tile = max(8, min(tile, 1 << max(0, (-(-rows // gate.shape[0]) - 1).bit_length())))
    dest, tile_expert, n_tiles = tile_layout(sizes, rows, tile)
    buf = jnp.zeros((n_tiles * tile, d), x.dtype).at[dest].set(x, mode="drop",
                                                               unique_indices=True)
    live = jnp.sum((sizes + tile - 1) // tile)  # the tiles that hold rows
    out = _tiles(activation, buf.reshape(n_tiles, tile, d), gate, up, down, tile_expert, live)
    return jnp.take(out.reshape(n_tiles * tile, d), dest, axis=0, mode="fill", fill_value=0)


def _weights(w: tuple[jax.Array, ...], e: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(lax.dynamic_index_in_dim(a, e, keepdims=False) for a in w)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiles(act: Callable, xt: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
           tile_expert: jax.Array, live: jax.Array) -> jax.Array:
    """``[T, tile, D]`` tiles, each through its expert's gated MLP; the ``live`` first ones
    (the rest are padding: zeros, not computed)."""
    def body(i, out):
        x, e = xt[i], tile_expert[i]
        g, u, dn = _weights((gate, up, down), e)
        h = (act(_dot(x, g)) * _dot(x, u)).astype(x.dtype)
        return lax.dynamic_update_index_in_dim(out, _dot(h, dn).astype(x.dtype), i, 0)

    return lax.fori_loop(0, live, body, varying_zeros(xt.shape, xt.dtype, xt, gate, up, down))


def _tiles_fwd(act, xt, gate, up, down, tile_expert, live):
    return _tiles(act, xt, gate, up, down, tile_expert, live), (xt, gate, up, down,
                                                                tile_expert, live)


def _tiles_bwd(act, res, dy):
    xt, gate, up, down, tile_expert, live = res
    # tiles come sorted by expert: one float32 accumulator for the expert of the moment (reset
    # after its last tile), not a float32 copy of the stack
    last = jnp.append(tile_expert[1:] != tile_expert[:-1], True)

    def body(i, carry):
        acc, out, dxs = carry
        x, g_out, e = xt[i], dy[i], tile_expert[i]
        g, u, dn = _weights((gate, up, down), e)
        a, b = _dot(x, g), _dot(x, u)
        s, act_vjp = jax.vjp(act, a)
        h = (s * b).astype(x.dtype)
        dh = _dot(g_out, dn.T)
        da, db = act_vjp(dh * b)[0], dh * s
        da, db = da.astype(x.dtype), db.astype(x.dtype)
        dx = (_dot(da, g.T) + _dot(db, u.T)).astype(x.dtype)
        acc = tuple(a_ + gr for a_, gr in zip(acc, (_dot(x.T, da), _dot(x.T, db),
                                                      _dot(h.T, g_out)), strict=True))
        # the sum so far into the expert's slot: its last tile writes the whole sum
        out = tuple(lax.dynamic_update_index_in_dim(o, a_.astype(o.dtype), e, 0)
                    for o, a_ in zip(out, acc, strict=True))
        acc = tuple(jnp.where(last[i], 0.0, a_) for a_ in acc)
        return acc, out, lax.dynamic_update_index_in_dim(dxs, dx, i, 0)

    weights = (gate, up, down)
    every = (xt, dy, *weights)
    init = (tuple(varying_zeros(w.shape[1:], jnp.float32, *every) for w in weights),
            tuple(varying_zeros(w.shape, w.dtype, *every) for w in weights),
            varying_zeros(xt.shape, xt.dtype, *every))
    _, (dg, du, dd), dx = lax.fori_loop(0, live, body, init)
    return dx, dg, du, dd, None, None


_tiles.defvjp(_tiles_fwd, _tiles_bwd)
