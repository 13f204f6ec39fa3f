"""One attention function for every model and backend: ``zjax.nn.attention``.

Causal or not, grouped-query (``K`` key/value heads under ``H`` query heads), an optional
sliding window (Mistral, Gemma 2), an optional logit soft-cap (Gemma 2), and segment ids (packed
documents: a query sees only keys of its own segment). ``implementation`` picks the kernel:

- ``auto`` (default): per backend the fastest that compiles and honours the mask, read from the
  mesh the call is traced under (so a plan for ``--target h100:8`` picks the H100's): splash on
  TPU; on GPU cuDNN where its library loads and the request allows it (no segment ids, no
  soft-cap), else Pallas Triton when the mask allows it, else blockwise; on CPU dense for short
  sequences (up to :data:`DENSE_UP_TO` keys, where it was measured faster) and blockwise beyond.
- ``dense``: scores, softmax, weighted sum: ``T x S`` float32 scores in memory.
- ``blockwise``: FlashAttention-2's algorithm in plain JAX with its own backward
  (:mod:`zjax.nn._blockwise`): any backend, memory linear in the length.
- ``splash``, ``triton``, ``cudnn``: the accelerators' kernels (:mod:`zjax.nn._kernels`); one
  that cannot honour the request is refused with the reason, never run without the mask.
"""

from __future__ import annotations

import jax

from zjax.nn._attend import (
    DENSE_UP_TO,
    IMPLEMENTATIONS,
    Mask,
    choose,
    dense_attention,
    local_attention,
    platform_kind,
    trace_platform,
)
from zjax.nn.context import context_attention
from zjax.nn.tensor_parallel import model_axis_size
from zjax.runtime.mesh import CONTEXT

__all__ = ["DENSE_UP_TO", "IMPLEMENTATIONS", "Mask", "attention", "choose", "dense_attention",
           "local_attention", "platform_kind", "trace_platform"]


def attention(q, k, v, *, segment_ids=None, causal: bool = True, window: int | None = None,
              softcap: float | None = None, scale: float | None = None,
              implementation: str = "auto", q_start=None, interpret: bool = False,
              block_size: int = 512, context: str = "auto") -> jax.Array:
    """Multi-head attention of ``q [B, T, H, D]`` over ``k``, ``v`` ``[B, S, K, D]``.

    Args:
      segment_ids: None, ``[B, T]`` ints (self-attention of packed documents), or a pair
        ``(q_ids [B, T], kv_ids [B, S])``.
      causal: query ``i`` (at position ``S - T + i``) sees keys up to its own position.
      window: causal only: the query sees the ``window`` positions ending at its own.
      softcap: scores become ``softcap * tanh(score / softcap)``.
      scale: multiplies ``q . k`` (default ``1 / sqrt(D)``).
      implementation: one of :data:`IMPLEMENTATIONS` (see the module docstring).
      q_start: dense only: the (possibly traced) position of the first query (decoding).
      interpret: run a Pallas kernel in its interpreter (tests on CPU).
      block_size: the blockwise implementation's tile (queries and keys).
      context: under a ``context`` axis: ``auto``, ``ulysses`` or ``ring``
        (:func:`zjax.nn.context.context_method`); ``none`` attends over the local tokens only.

    Returns:
      ``[B, T, H, D]`` in ``q``'s dtype.

    Raises:
      ArgumentError: a bad shape or option, or a kernel that cannot honour the mask.
    """
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale,
              implementation=implementation, block_size=block_size)
    if context != "none" and q_start is None and model_axis_size(CONTEXT) > 1:
        ids = segment_ids[0] if isinstance(segment_ids, tuple | list) else segment_ids
        return context_attention(q, k, v, axis_name=CONTEXT, method=context,
                                 segment_ids=ids, **kw)
    return local_attention(q, k, v, segment_ids=segment_ids, q_start=q_start,
                           interpret=interpret, **kw)
