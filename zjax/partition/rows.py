"""Token embeddings looked up where their rows live (stage 3), not gathered whole.

Gathering a vocabulary-sharded embedding table to read a few thousand of its rows moves the
whole table (Llama 3 8B: 1.05 GB a step, and as much again reduce-scattered as its
gradient). :func:`take_rows` instead gathers the token ids over the table's axis (a few KB),
reads the rows this device holds (zeros for the others) and reduce-scatters the rows back to
the devices whose tokens they are; the backward all-gathers the rows' gradient and adds it
into this device's shard, which needs no reduce-scatter. That moves ``tokens x D`` both ways
instead of ``vocab x D``: it runs where the tokens over the table's axis are fewer than the
table's rows, and otherwise the table is gathered as before.

A model opts in per weight (NNX metadata ``rows=True``, a table read only by
:func:`take_rows`); zjax's stage 3 then hands it a :class:`Rows`. Read any other way
(``rows[...]``) a :class:`Rows` is the whole gathered table.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from zjax.partition.gather import Comm, all_gather, gather

__all__ = ["Rows", "take_rows"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["shard", "whole"],
                   meta_fields=["comm", "rows"])
@dataclasses.dataclass(frozen=True)
class Rows:
    """An embedding table sharded over ``comm.axis_name`` along its rows (dimension 0).

    Attributes:
      shard: this device's rows, ``[rows / n, D]``.
      comm: how the table is gathered (a plain gather: not quantized, on the device).
      rows: the whole table's rows.
      whole: the table gathered already, or None (gathered when read): XLA:CPU gathers it
        with the step's other gathers, ordered before the layer loops (``join_gathers``);
        it is only read where the rows are not looked up.
    """

    shard: jax.Array
    comm: Comm
    rows: int
    whole: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shard.shape[1:])

    @property
    def dtype(self):
        return jnp.dtype(self.comm.gather_dtype)

    def full(self) -> jax.Array:
        """The whole table, gathered (in the gather dtype)."""
        return gather(self.shard, dim=0, comm=self.comm) if self.whole is None else self.whole

    def __getitem__(self, index):
        return self.full()[index]


def take_rows(table: jax.Array | Rows, ids: jax.Array) -> jax.Array:
    """``jnp.take(table, ids, axis=0)``; for a :class:`Rows` table, looked up where the rows
    live when the ids over its axis are fewer than its rows (rows outside ``[0, rows)`` read
    as zeros), else from the gathered table."""
    if not isinstance(table, Rows):
        return jnp.take(table, ids, axis=0)
    if lax.axis_size(table.comm.axis_name) * ids.size >= table.rows:
        return jnp.take(table.full(), ids, axis=0)
    return _lookup(table.shard, ids, table.comm)


def _local(ids: jax.Array, held: int, axis) -> tuple[jax.Array, jax.Array]:
    """The ids' rows in this device's shard of ``held`` rows, and which of them it holds."""
    local = ids - lax.axis_index(axis) * held
    hit = (local >= 0) & (local < held)
    return jnp.where(hit, local, 0), hit


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(shard: jax.Array, ids: jax.Array, comm: Comm) -> jax.Array:
    return _lookup_fwd(shard, ids, comm)[0]


def _lookup_fwd(shard, ids, comm):
    axis = comm.axis_name
    every = all_gather(ids[None], axis, axis=0)  # [n, *ids.shape]: every device's ids
    local, hit = _local(every, shard.shape[0], axis)
    rows = jnp.where(hit[..., None], jnp.take(shard, local, axis=0), 0).astype(comm.gather_dtype)
    # one device holds each row: the sum is exact, in any dtype
    out = lax.psum_scatter(rows, axis, scatter_dimension=0, tiled=True)[0]
    return out, (local, hit, jnp.zeros((shard.shape[0], 0), shard.dtype))  # the shard's rows


def _lookup_bwd(comm, res, g):
    local, hit, like = res
    every = all_gather(g[None], comm.axis_name, axis=0)  # every device's rows' gradient
    held = jnp.where(hit[..., None], every, 0).astype(jnp.float32)
    d = jnp.zeros((like.shape[0], g.shape[-1]), jnp.float32).at[local].add(held)
    return d.astype(like.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
