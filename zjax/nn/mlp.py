"""A token-wise function over chunks of tokens, recomputed chunk by chunk in the backward
(ALST's TiledMLP).

An MLP's working set is ``tokens x d_ff``: at 32k tokens and Llama 3 8B's 14336 hidden units
each of its gate, up and product tensors is 0.9 GB in bfloat16, and the backward holds
several. :func:`tiled` runs the function ``chunk`` tokens at a time under ``lax.map`` with
each chunk checkpointed: the forward keeps only the chunk's input (a slice of the layer's own
input), the backward recomputes one chunk's hidden units, takes its gradients and adds the
weights' share before the next chunk, so the working set is ``chunk x d_ff`` whatever the
sequence. The price is one more forward of the MLP in the backward (under a layer's remat it
is then computed three times) and a loop that XLA cannot fuse across.

Chunks of tokens sum each weight's gradient over the chunks (a buffer the size of the weights
beside each chunk's share). Where the weights train and a device's tokens are few next to
them, :func:`tiled_hidden` slices the hidden units instead: each slice's weight gradients are
written once, and only the output and the input's gradient are summed. Where neither would
hold less than the untiled MLP (few tokens next to wide weights) it is not tiled:
:func:`choose_tiling` decides.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._split_mlp import split_hidden

__all__ = ["choose_tiling", "divisor_slices", "tiled", "tiled_hidden"]


def tiled(fn: Callable[[jax.Array], jax.Array], x: jax.Array, *, chunk: int) -> jax.Array:
    """``fn(x)`` for a token-wise ``fn``, computed ``chunk`` tokens at a time.

    Args:
      fn: maps ``[n, D]`` to ``[n, E]`` row by row (an MLP; the weights it closes over get
        their gradients summed over the chunks).
      x: ``[..., D]``; every leading position is a token.
      chunk: tokens per chunk; 0, or at least the token count, calls ``fn`` once, untiled.
        A count the chunk does not divide is padded (the padding rows are computed and
        dropped, and get no gradient).

    Returns:
      ``[..., E]``, equal to ``fn(x)`` up to the order of the weights' gradient sums.
    """
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    count = flat.shape[0]
    if chunk <= 0 or count <= chunk:
        return fn(x)
    n = -(-count // chunk)
    if n * chunk != count:
        flat = jnp.pad(flat, ((0, n * chunk - count), (0, 0)))
    # checkpointed: the scan's residuals are each chunk's input, not its hidden units
    out = lax.map(jax.checkpoint(fn), flat.reshape(n, chunk, d))
    return out.reshape(n * chunk, -1)[:count].reshape(*lead, -1)


def tiled_hidden(hidden: Callable, x: jax.Array, ins: tuple, down: jax.Array, *,
                 chunk: int) -> jax.Array:
    """``hidden(x, *ins) @ down`` (an MLP) holding as many hidden units at a time as ``chunk``
    tokens of it would: the hidden units sliced, each slice's weight gradients written once.

    Args:
      hidden: ``(x [N, D], *slices) -> [N, c]``, the hidden units of weight slices (each
        array of ``ins`` sliced on its last axis).
      x: ``[..., D]``; every leading position is a token.
      ins: the up-projections (and their biases), hidden units on the last axis.
      down: ``[d_ff, D_out]``.
      chunk: the tokens whose ``[chunk, d_ff]`` hidden units bound the working set: the
        hidden units go in the fewest slices dividing ``d_ff`` that hold no more (0, or at
        least the token count: one piece, untiled).

    Returns:
      ``[..., D_out]``, equal to the untiled MLP up to the order of the sums over slices
      (the output and the input's gradient).
    """
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    pieces = divisor_slices(flat.shape[0], down.shape[0], chunk)
    if pieces == 1:
        return (hidden(flat, *ins) @ down).reshape(*lead, -1)
    return split_hidden(hidden, flat, tuple(ins), down, pieces).reshape(*lead, -1)


def divisor_slices(tokens: int, width: int, chunk: int) -> int:
    """The fewest slices of ``width`` (hidden units, a vocabulary), dividing it, each at most
    ``chunk / tokens`` of it: as many elements a slice as ``chunk`` tokens of the whole
    (1: unsliced)."""
    if chunk <= 0 or tokens <= chunk:
        return 1
    want = -(-tokens // chunk)
    return next(p for p in range(min(want, width), width + 1) if width % p == 0)


def choose_tiling(*, tokens: int, d_model: int, d_ff: int, chunk: int, weight_bytes: int,
                  act_bytes: int, trainable: bool) -> tuple[str, int]:
    """How to tile an MLP for ``model.mlp_chunk``: ``("none" | "tokens" | "hidden", pieces)``,
    whichever is estimated to hold the least, so that tiling never costs memory.

    The untiled backward holds the hidden units (``tokens x d_ff``: about eight such tensors,
    the planner's estimate); a tiling holds a piece's share of them, plus, over tokens, a sum
    of the weights' gradients beside each chunk's share (about 1.5x the weights: measured),
    and over hidden units each slice's copy of the weights and of their gradients and two
    float32 ``tokens x d_model`` sums. Frozen weights (LoRA's base) get no gradient: tokens.
    """
    if chunk <= 0 or tokens <= chunk:
        return "none", 1
    held = 8 * tokens * d_ff * act_bytes
    by_tokens = -(-tokens // chunk)
    by_hidden = divisor_slices(tokens, d_ff, chunk)
    costs = {"none": (held, 1),
             "tokens": (held // by_tokens + (3 * weight_bytes // 2 if trainable else 0),
                        by_tokens)}
    if trainable and by_hidden <= 2 * by_tokens:  # (no divisor of d_ff near: slivers)
        costs["hidden"] = (held // by_hidden + 2 * weight_bytes // by_hidden
                           + 8 * tokens * d_model, by_hidden)
    how = min(costs, key=lambda k: costs[k][0])  # a tie keeps the first: untiled
    return how, costs[how][1]
