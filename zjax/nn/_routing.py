"""A mixture of experts' router: softmax top-k choices (Mixtral's), DeepSeek-V3's sigmoid
scores with group-limited top-k and a selection-only bias, and the statistics its auxiliary
losses take (Switch / Hugging Face's load balance, ST-MoE's z-loss) over the whole batch."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.runtime.mesh import CONTEXT, DATA, EXPERT, NODE, REPLICA

__all__ = ["RouterStats", "Routing", "batch_sum", "load_feedback", "route", "route_sigmoid",
           "router_stats", "sequence_balance"]

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


def route(logits: jax.Array, *, k: int, renormalize: bool = True, groups: int = 1,
          topk_groups: int = 1, scaling: float = 1.0) -> Routing:
    """Mixtral's router: a softmax over the experts, the top ``k`` kept.

    Args:
      logits: ``[N, E]`` router logits (computed in any dtype; the softmax is float32).
      k: experts per token.
      renormalize: divide the kept probabilities by their sum (Mixtral; Qwen3-MoE's
        ``norm_topk_prob``); False keeps them as they are (Qwen2-MoE, DeepSeek's V2).
      groups: DeepSeek-V2's ``group_limited_greedy``: the experts form this many groups, each
        scored by its best probability, and only the ``topk_groups`` best groups' experts
        may be chosen (the others read 0); 1: every expert.
      scaling: the kept weights times this (DeepSeek-V2's ``routed_scaling_factor``).
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    choice = probs if groups == 1 else _in_best_groups(
        probs, groups, topk_groups, lambda g: jnp.max(g, axis=-1))
    weights, experts = lax.top_k(choice, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights * scaling, experts.astype(jnp.int32), probs, logits)


def _in_best_groups(choice: jax.Array, groups: int, topk_groups: int, score) -> jax.Array:
    """``choice`` with the experts outside the ``topk_groups`` groups of the best ``score``
    set to 0 (transformers' ``masked_fill(~mask, 0.0)``)."""
    n, n_experts = choice.shape
    by_group = choice.reshape(n, groups, n_experts // groups)
    best = lax.top_k(score(by_group), topk_groups)[1]
    keep = jnp.zeros((n, groups), bool).at[jnp.arange(n)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], by_group, 0.0).reshape(n, n_experts)


def route_sigmoid(logits: jax.Array, bias: jax.Array, *, k: int, groups: int = 1,
                  topk_groups: int = 1, renormalize: bool = True,
                  scaling: float = 1.0) -> Routing:
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``): sigmoid scores; the
    choice reads ``scores + bias`` (the auxiliary-loss-free balancing bias, selection only);
    with ``groups`` > 1 the experts form that many groups, each scored by its two best
    choices, and only the ``topk_groups`` best groups' experts may be chosen (the others
    read 0, as transformers masks them); the kept scores (not the biased ones), divided by
    their sum where ``renormalize`` (``norm_topk_prob``), times ``scaling``
    (``routed_scaling_factor``).

    ``probs`` holds the scores normalised to sum to 1 per token, what DeepSeek's balance loss
    reads.
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits)
    choice = scores + lax.stop_gradient(bias).astype(jnp.float32)
    if groups > 1:  # a group's score: its two best choices
        choice = _in_best_groups(choice, groups, topk_groups,
                                 lambda g: jnp.sum(lax.top_k(g, 2)[0], axis=-1))
    experts = lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return Routing(weights * scaling, experts.astype(jnp.int32), probs, logits)


# the load error travels as the bias's gradient at a scale that leaves a global gradient norm
# (and so clipping) unchanged in practice; the bias's update reads only its sign
_FEEDBACK_SCALE = 2.0 ** -40


@jax.custom_vjp
def _feedback(bias: jax.Array, error: jax.Array) -> jax.Array:
    return bias


def _feedback_fwd(bias, error):
    return bias, error


def _feedback_bwd(error, _):
    return error * _FEEDBACK_SCALE, jnp.zeros_like(error)


_feedback.defvjp(_feedback_fwd, _feedback_bwd)


def load_feedback(routing: Routing, bias: jax.Array) -> Routing:
    """``routing`` whose backward gives ``bias`` the load error of this device's tokens as its
    gradient: ``(load_e - mean load) x 2^-40``, ``load_e`` the assignments expert ``e`` took.

    Summed over devices and micro-batches by the step like any gradient, its sign is the
    batch's: DeepSeek-V3's auxiliary-loss-free update
    (:func:`zjax.step.optim.with_router_bias`) moves the bias by ``-speed x sign``, down
    for an overloaded expert and up for an idle one. The forward is unchanged (the bias joins
    the weights times 0).
    """
    n_experts = bias.shape[-1]
    load = jnp.bincount(routing.experts.reshape(-1), length=n_experts).astype(jnp.float32)
    error = lax.stop_gradient(load - jnp.mean(load))
    fed = _feedback(bias, error)
    weights = routing.weights + 0.0 * jnp.take(fed, routing.experts).astype(jnp.float32)
    return routing._replace(weights=weights)


class RouterStats(NamedTuple):
    """One layer's (or a sum over layers') router statistics on this device's tokens.

    ``balance`` and ``z`` are this device's shares of the batch's means (their sums over the
    devices are the layer's losses), ``dropped`` the count of its token-expert assignments
    that a capacity dropped, ``max_violation`` the batch's most loaded expert over the mean
    load, minus 1 (DeepSeek's MaxVio; the same on every device), ``seq_balance`` this
    device's share of DeepSeek-V3's sequence-wise balance loss (:func:`sequence_balance`; 0
    unless asked). Float32 scalars; a ``Stack`` carries their sum over its layers.
    """

    balance: jax.Array
    z: jax.Array
    dropped: jax.Array
    max_violation: jax.Array
    seq_balance: jax.Array

    @classmethod
    def zeros(cls) -> RouterStats:
        z = jnp.zeros((), jnp.float32)
        return cls(z, z, z, z, z)

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
    violation = jnp.max(total[:-1]) / jnp.maximum(jnp.mean(total[:-1]), 1e-9) - 1.0
    return RouterStats(balance, z, lost, violation, jnp.zeros((), jnp.float32))


def sequence_balance(routing: Routing, sequences: int, mask: jax.Array | None = None
                     ) -> jax.Array:
    """This device's share of DeepSeek-V3's sequence-wise balance loss, the mean over the
    batch's sequences of ``sum_e f_e P_e``: ``f_e = E / (k T)`` times the sequence's tokens
    that chose expert ``e``, ``P_e`` the mean over its ``T`` tokens of the router's scores
    normalised per token (``routing.probs``). The ``N`` tokens are ``sequences`` rows of equal
    length; ``mask`` leaves padding out of ``T`` and both sums."""
    n, e = routing.probs.shape
    k = routing.experts.shape[1]
    m = jnp.ones((n,), jnp.float32) if mask is None else mask.astype(jnp.float32)
    seq = jnp.arange(n) // (n // sequences)
    counts = jax.ops.segment_sum(jnp.repeat(m, k), jnp.repeat(seq, k) * e
                                 + routing.experts.reshape(-1), num_segments=sequences * e)
    tokens = jnp.maximum(jax.ops.segment_sum(m, seq, num_segments=sequences), 1.0)
    f = lax.stop_gradient(counts.reshape(sequences, e) * e / (k * tokens[:, None]))
    p = jax.ops.segment_sum(m[:, None] * routing.probs, seq, num_segments=sequences)
    per_sequence = jnp.sum(f * p / tokens[:, None], axis=-1)
    return jnp.sum(per_sequence) / batch_sum(jnp.asarray(sequences, jnp.float32))
