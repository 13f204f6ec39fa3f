"""A mixture of experts' router: softmax top-k choices, and the statistics its auxiliary losses
take (Switch / Hugging Face's load balance, ST-MoE's z-loss) over the whole batch."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.runtime.mesh import CONTEXT, DATA, EXPERT, NODE, REPLICA

__all__ = ["RouterStats", "Routing", "batch_sum", "route", "router_stats"]

# the mesh axes a step splits its batch's tokens over (never ``model``: its devices hold the
# same tokens)
_TOKEN_AXES = (REPLICA, NODE, DATA, EXPERT, CONTEXT)


def batch_sum(x):
    """``x`` summed over the mesh axes that split the batch's tokens, where bound (inside a
    zjax step's ``shard_map``); ``x`` itself outside one (a single-device reference)."""
    axes = []
    for name in _TOKEN_AXES:
        try:
            lax.axis_size(name)
        except NameError:  # not bound in this trace
            continue
        axes.append(name)
    return lax.psum(x, tuple(axes)) if axes else x


class Routing(NamedTuple):
    """Where each token goes.

    Attributes:
      weights: ``[N, k]`` float32: how much of each chosen expert's output the token takes.
      experts: ``[N, k]`` int32: the chosen experts, best first.
      probs: ``[N, E]`` float32: the softmax over every expert (the balance loss reads it).
      logits: ``[N, E]`` float32 (the z-loss reads them).
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(logits: jax.Array, *, k: int, renormalize: bool = True) -> Routing:
    """Mixtral's router: a softmax over the experts, the top ``k`` kept.

    Args:
      logits: ``[N, E]`` router logits (computed in any dtype; the softmax is float32).
      k: experts per token.
      renormalize: divide the kept probabilities by their sum (Mixtral; Qwen3-MoE's
        ``norm_topk_prob``); False keeps them as they are (Qwen2-MoE, DeepSeek's V2).
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, experts.astype(jnp.int32), probs, logits)


class RouterStats(NamedTuple):
    """One layer's (or a sum over layers') router statistics on this device's tokens.

    ``balance`` and ``z`` are this device's shares of the batch's means (their sums over the
    devices are the layer's losses), ``dropped`` the count of its token-expert assignments
    that a capacity dropped. Float32 scalars; a ``Stack`` carries their sum over its layers.
    """

    balance: jax.Array
    z: jax.Array
    dropped: jax.Array

    @classmethod
    def zeros(cls) -> RouterStats:
        z = jnp.zeros((), jnp.float32)
        return cls(z, z, z)

    def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
        return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))


def router_stats(routing: Routing, mask: jax.Array | None = None,
                 dropped: jax.Array | None = None) -> RouterStats:
    """The load-balance and z-loss shares of this device's tokens.

    Balance (Switch Transformer's, as Hugging Face's ``load_balancing_loss_func`` scales it):
    ``E * sum_e f_e P_e``, ``f_e`` the fraction of the batch's tokens that chose expert ``e``
    among their ``k`` (the fractions sum to ``k``), ``P_e`` the mean router probability of
    ``e``. ``f`` counts the whole batch (one small all-reduce over the batch's axes, no
    gradient), so the loss is the single-device one however the batch is split. Z-loss
    (ST-MoE): the mean of ``logsumexp(logits)^2``. Means are over the tokens ``mask`` keeps
    (1: a token, 0: padding; None: all).

    Args:
      routing: the router's choices on ``N`` tokens.
      mask: ``[N]`` float weights, or None.
      dropped: ``[N, k]`` bools: assignments a capacity dropped (None: none).
    """
    n, n_experts = routing.probs.shape
    m = jnp.ones((n,), jnp.float32) if mask is None else mask.astype(jnp.float32)
    k = routing.experts.shape[1]
    # tokens per expert (each of a token's k choices counts): a segment sum, not [N, k, E]
    picked = jax.ops.segment_sum(jnp.repeat(m, k), routing.experts.reshape(-1),
                                 num_segments=n_experts)
    local = jnp.concatenate([picked, jnp.sum(m)[None]])
    total = batch_sum(lax.stop_gradient(local))
    tokens = jnp.maximum(total[-1], 1.0)
    fraction = total[:-1] / tokens
    balance = n_experts * ((m @ routing.probs) @ fraction) / tokens
    lse = jax.nn.logsumexp(routing.logits, axis=-1)
    z = jnp.sum(m * lse * lse) / tokens
    lost = jnp.zeros((), jnp.float32) if dropped is None else \
        jnp.sum(m[:, None] * dropped.astype(jnp.float32))
    return RouterStats(balance, z, lost)
