"""A mixture-of-experts feed-forward layer for any model: a softmax top-k router (Mixtral's;
Qwen-MoE's and DeepSeek's without renormalisation) and gated-MLP experts, dropless by default.

- **Dropless** (:func:`moe_ffn` with ``capacity_factor=None``): each token is copied to its
  ``k`` experts, the copies sorted by expert and run through grouped matmuls
  (``jax.lax.ragged_dot``); every assignment is computed, none padded.
- **Capacity** (``capacity_factor=c``): GShard's rule: each expert takes at most
  ``ceil(c * N * k / E)`` of the ``N`` tokens' assignments, first choices first; the rest are
  dropped (counted in :class:`RouterStats`). Its buffers are static ``[E, capacity, D]``.

Under expert parallelism (inside a step whose mesh has an ``expert`` axis of ``n``), the
experts' weights arrive as this device's ``E / n`` experts and the assignments travel to
their experts' devices and back by all-to-all over the axis (:mod:`zjax.nn._dispatch`);
dropless, only the routed rows (a ragged all-to-all, :mod:`zjax.nn._ragged`).

The router's auxiliary losses are returned as statistics (:class:`RouterStats`), a
load-balance share and a z-loss share of this device's tokens, whose sums over the devices are
the batch's losses; the model adds them to its loss with its coefficients
(:func:`zjax.models.lm_loss` does for the reference Llama). Under tensor parallelism the
experts' hidden units are split over ``model`` like a dense MLP's (the caller sums the partial
outputs, :func:`zjax.nn.row_parallel_output`); the router sees the whole input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zjax.nn._dispatch import parallel_capacity, parallel_dropless
from zjax.nn._experts import Experts, capacity, dropless, grouped, with_capacity
from zjax.nn._grouped import GROUPED_MATMULS, tiled_mlp
from zjax.nn._routing import (
    RouterStats,
    Routing,
    batch_sum,
    load_feedback,
    route,
    route_sigmoid,
    router_stats,
    sequence_balance,
)
from zjax.nn.tensor_parallel import column_parallel_input, model_axis_size
from zjax.runtime.mesh import EXPERT

__all__ = ["GROUPED_MATMULS", "Experts", "RouterStats", "Routing", "Scoring", "batch_sum",
           "capacity", "grouped", "load_feedback", "moe_ffn", "route", "route_sigmoid",
           "router_stats", "sequence_balance", "tiled_mlp"]


class Scoring(NamedTuple):
    """DeepSeek's router settings: V3's (:func:`route_sigmoid`), or with ``sigmoid`` False
    V2's softmax groups and scaling (:func:`route`).

    Attributes:
      bias: ``[E]`` the selection bias (``e_score_correction_bias``; V3 only).
      groups: expert groups (``n_group``).
      topk_groups: groups a token may choose from (``topk_group``).
      scaling: the routed output's factor (``routed_scaling_factor``).
      sigmoid: V3's sigmoid scores (else V2's softmax, groups scored by their best).
    """

    bias: jax.Array | None
    groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    sigmoid: bool = True


def moe_ffn(x: jax.Array, router: jax.Array, experts: Experts, *, k: int,
            renormalize: bool = True, capacity_factor: float | None = None,
            activation: Callable = jax.nn.silu, mask: jax.Array | None = None,
            matmul: str = "auto", exchange: str = "auto", chunks: int = 1,
            scoring: Scoring | None = None,
            sequences: int | None = None) -> tuple[jax.Array, RouterStats]:
    """The routed experts' output for tokens ``x``.

    Under tensor parallelism (inside a step with a ``model`` axis, each expert's hidden units
    split over it as :mod:`zjax.partition.rules` splits ``mlp``), ``x`` is the input as every
    ``model`` device holds it, unmarked: the router reads it whole, and the experts' input and
    the combine weights enter the tensor-parallel region here
    (:func:`zjax.nn.column_parallel_input`, which sums their gradients over ``model``); the
    output is then each device's partial sum, for the caller's
    :func:`zjax.nn.row_parallel_output`. Outside a ``model`` axis both marks are the identity.

    Args:
      x: ``[N, D]`` tokens.
      router: ``[D, E]`` router weights (Hugging Face's ``gate.weight`` transposed).
      experts: the ``E`` experts' weights (:class:`Experts`); under expert parallelism this
        device's ``E / n``.
      k: experts per token (at most ``E``).
      renormalize: the kept probabilities divided by their sum (:func:`route`).
      capacity_factor: None (dropless), or each expert's capacity as a multiple of an even
        share of the assignments (:func:`capacity`).
      activation: the gated MLP's activation (SwiGLU: silu).
      mask: ``[N]`` 1 for a token, 0 for padding: which tokens the router's statistics count.
      matmul: dropless experts' grouped matmul: ``auto``, ``ragged_dot`` or ``tiled``
        (``ragged_dot``: three ``lax.ragged_dot``, native on TPU, a dense expansion on
        XLA:CPU and XLA:GPU; ``tiled``: :func:`tiled_mlp`; ``auto``: ``ragged_dot`` on TPU,
        ``tiled`` elsewhere; :func:`grouped`).
      exchange: how dropless assignments travel under expert parallelism: ``auto``,
        ``ragged`` (``lax.ragged_all_to_all``, XLA:GPU and TPU) or ``chunked`` (fixed-size
        rounds, any backend); ``auto``: ``chunked`` on XLA:CPU (it has no
        ``ragged-all-to-all``), ``ragged`` elsewhere. Either moves the routed rows only.
      chunks: under dropless expert parallelism, the tokens in this many independent
        exchanges (one's all-to-all overlaps another's experts); where it does not divide
        ``N``, their greatest common divisor.
      scoring: DeepSeek-V3's router (:class:`Scoring`: sigmoid scores, the selection bias,
        expert groups, the scaling factor); None: the softmax router. Its ``bias`` gets the
        load error as its gradient (:func:`load_feedback`).
      sequences: the tokens are this many equal sequences: the statistics then hold
        DeepSeek-V3's sequence-wise balance share (:func:`sequence_balance`); None: 0.

    Returns:
      ``([N, D] output in x's dtype, this device's RouterStats)``.
    """
    n_experts, ep = router.shape[-1], model_axis_size(EXPERT)
    if experts.gate.shape[0] * ep != n_experts:
        raise ValueError(f"{experts.gate.shape[0]} experts on each of {ep} devices of the "
                         f"{EXPERT} axis, for a router over {n_experts}")
    if not 1 <= k <= n_experts:
        raise ValueError(f"k = {k} experts per token, with {n_experts} experts")
    if scoring is None:
        routing = route(x @ router.astype(x.dtype), k=k, renormalize=renormalize)
    else:  # transformers' DeepSeek routers score float32 inputs
        logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
        kw = dict(k=k, groups=scoring.groups, topk_groups=scoring.topk_groups,
                  renormalize=renormalize, scaling=scoring.scaling)
        routing = route(logits, **kw) if not scoring.sigmoid else load_feedback(
            route_sigmoid(logits, scoring.bias, **kw), scoring.bias)
    # the weights scale partial sums under tensor parallelism: their gradient is summed
    split = routing._replace(weights=column_parallel_input(routing.weights))
    x = column_parallel_input(x)
    kw = dict(activation=activation) if ep == 1 else dict(activation=activation, axis=EXPERT)
    dropped = None
    if capacity_factor is None and ep == 1:
        y = dropless(x, split, experts, matmul=matmul, **kw)
    elif capacity_factor is None:
        y = parallel_dropless(x, split, experts, matmul=matmul, exchange=exchange,
                              pieces=chunks, **kw)
    else:
        run = with_capacity if ep == 1 else parallel_capacity
        y, dropped = run(x, split, experts, factor=capacity_factor, **kw)
    stats = router_stats(routing, mask, dropped)
    if sequences is not None:
        stats = stats._replace(seq_balance=sequence_balance(routing, sequences, mask))
    return y, stats
