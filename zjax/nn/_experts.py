"""The experts of a mixture: every token-expert assignment through its expert's gated MLP,
dropless on grouped matmuls, or into per-expert buffers of a fixed capacity (GShard)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._attend import trace_platform
from zjax.nn._grouped import GROUPED_MATMULS, tiled_mlp
from zjax.nn._routing import Routing

__all__ = ["Experts", "batched", "capacity", "capacity_slots", "combine", "dropless", "grouped",
           "with_capacity"]


class Experts(NamedTuple):
    """The experts' gated-MLP weights, stacked on a leading expert dimension ``E``.

    Attributes:
      gate: ``[E, D, F]``.
      up: ``[E, D, F]``.
      down: ``[E, F, D]``.
    """

    gate: jax.Array
    up: jax.Array
    down: jax.Array


def grouped(x: jax.Array, w: Experts, sizes: jax.Array, act: Callable, *,
            matmul: str = "auto") -> jax.Array:
    """Rows of ``x`` sorted by expert (``sizes[e]`` rows for expert ``e``, then padding rows)
    through their experts' gated MLP.

    ``matmul``: ``ragged_dot`` (three ``lax.ragged_dot``: native on TPU, a dense expansion on
    XLA:CPU and XLA:GPU), ``tiled`` (:func:`zjax.nn.moe.tiled_mlp`: whole tiles of one
    expert's rows, a scan), or ``auto``: ``ragged_dot`` on TPU, ``tiled`` elsewhere (the
    platform of the mesh traced under, so a plan for a target picks the target's).
    """
    if matmul not in GROUPED_MATMULS:
        raise ValueError(f"matmul: {matmul!r}; expected one of {', '.join(GROUPED_MATMULS)}")
    if matmul == "auto":
        matmul = "ragged_dot" if trace_platform() == "tpu" else "tiled"
    if matmul == "tiled":
        return tiled_mlp(x, w.gate, w.up, w.down, sizes, activation=act)
    h = act(lax.ragged_dot(x, w.gate, sizes)) * lax.ragged_dot(x, w.up, sizes)
    return lax.ragged_dot(h.astype(x.dtype), w.down, sizes)


def combine(y: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """``[N, k, D]`` expert outputs weighted by ``[N, k]`` and summed per token, in float32."""
    return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1).astype(dtype)


def dropless(x: jax.Array, routing: Routing, w: Experts, *,
             activation: Callable = jax.nn.silu, matmul: str = "auto") -> jax.Array:
    """Every assignment computed: ``[N, D]`` tokens copied ``k`` times, sorted by expert, run
    through grouped matmuls (:func:`grouped`'s ``matmul``) and summed back with the routing
    weights."""
    n, d = x.shape
    k, n_experts = routing.experts.shape[1], w.gate.shape[0]
    flat = routing.experts.reshape(-1)  # assignment t * k + j
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    ys = grouped(jnp.take(x, order // k, axis=0), w, sizes, activation, matmul=matmul)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)  # back in assignment order
    return combine(y.reshape(n, k, d), routing.weights, x.dtype)


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Assignments each expert takes: ``ceil(factor * tokens * k / n_experts)``, at least 1."""
    return max(1, math.ceil(factor * tokens * k / n_experts))


def capacity_slots(routing: Routing, n_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """GShard's queue: each assignment's slot in the ``[E * cap]`` buffers (``E * cap`` past the
    end for a dropped one) and whether it is kept, in priority order (assignment ``j * N + t``:
    all first choices, then all second ones, token order within)."""
    n, k = routing.experts.shape
    flat = routing.experts.T.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.arange(n * k) - starts[flat[order]]  # place in its expert's queue, sorted
    place = jnp.zeros_like(rank).at[order].set(rank, unique_indices=True)
    keep = place < cap
    return jnp.where(keep, flat * cap + place, n_experts * cap), keep


def batched(buf: jax.Array, w: Experts, act: Callable) -> jax.Array:
    """``[E, C, D]`` buffers through their experts as batched matmuls."""
    h = act(jnp.einsum("ecd,edf->ecf", buf, w.gate)) * jnp.einsum("ecd,edf->ecf", buf, w.up)
    return jnp.einsum("ecf,efd->ecd", h.astype(buf.dtype), w.down)


def with_capacity(x: jax.Array, routing: Routing, w: Experts, *, factor: float,
                  activation: Callable = jax.nn.silu,
                  experts_fn: Callable | None = None) -> tuple[jax.Array, jax.Array]:
    """GShard's dispatch: each expert takes at most :func:`capacity` assignments, first
    choices before second ones (all tokens' first, then all their second...), in token order
    within a choice; the rest are dropped (the token keeps its residual stream and its other
    experts). The experts run as one batched matmul over ``[E, capacity, D]`` buffers
    (``experts_fn(buffers)`` instead: expert parallelism's all-to-all around them).

    Returns:
      ``([N, D] output, [N, k] bools: the dropped assignments)``.
    """
    n, d = x.shape
    k, n_experts = routing.experts.shape[1], routing.probs.shape[1]
    cap = capacity(n, k, n_experts, factor)
    slot, keep = capacity_slots(routing, n_experts, cap)
    rows = jnp.take(x, jnp.arange(n * k) % n, axis=0)
    buf = jnp.zeros((n_experts * cap, d), x.dtype).at[slot].add(rows, mode="drop")
    buf = buf.reshape(n_experts, cap, d)
    out = (experts_fn or (lambda b: batched(b, w, activation)))(buf)
    out = out.reshape(n_experts * cap, d)
    y = jnp.take(out, slot, axis=0, mode="fill", fill_value=0)  # a dropped one: zeros
    y = jnp.moveaxis(y.reshape(k, n, d), 0, 1)
    return combine(y, routing.weights, x.dtype), ~keep.reshape(k, n).T
