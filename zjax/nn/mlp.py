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
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["tiled"]


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
