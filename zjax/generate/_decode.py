"""KV-cached decoding: the prompt runs once (``decode`` at position 0), then each new token
attends to the cached keys and values, so a step costs one token's forward pass, not the whole
sequence's; the loop over new tokens is a ``lax.while_loop`` inside one ``jit`` that ends once
every row has drawn a stop id. Sampling is by temperature and nucleus (top-p); temperature 0
is greedy. Prompts of different lengths go in one batch left-padded, with their lengths:
``decode`` then hides each row's padding and counts its positions from its first real token,
so every row decodes as its prompt alone would. Used by ``zjax sample``
(:mod:`zjax.export.sample`) and meant for RL rollouts: it lies below the training run so that
the trainer can call it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zjax.errors import ArgumentError, ConfigError

__all__ = ["decode_tokens", "generate", "pick", "until_stop"]


def pick(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float) -> jax.Array:
    """Token ids ``[B]`` drawn from float32 ``logits`` ``[B, V]``.

    ``temperature`` 0 takes the most likely token; otherwise the logits are divided by it and
    the draw is from the smallest set of tokens whose probability reaches ``top_p`` (at least
    the most likely one).
    """
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the likelier tokens
        kept = jnp.where(before < top_p, ordered, jnp.inf).min(axis=-1, keepdims=True)
        logits = jnp.where(logits >= kept, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1)


def decode_tokens(model: nnx.Module, prompt: jax.Array, pads: jax.Array | None,
                  key: jax.Array, stop: jax.Array, *, new: int, temperature: float,
                  top_p: float, cache_dtype=jnp.float32) -> jax.Array:
    """``new`` tokens after each row of ``prompt`` ``[B, L]`` (int): ``[B, new]``, traceable.

    What :func:`generate` runs, for callers inside their own ``jax.jit`` (an RL rollout).

    Args:
      model: the (merged) model, with ``init_cache`` and ``decode``.
      prompt: the prompts, each row's tokens at its end when ``pads`` is given.
      pads: int ``[B]``, the padding positions that lead each row, or None (no padding:
        ``decode`` is called without it, the program of unpadded decoding).
      key: token ``i`` of every row draws with the ``i``-th of ``new`` keys split from it.
      stop: int ids ``[n]`` that end a row (``[-1]`` for none); once every row has drawn one
        the loop ends, and the positions after are -1.
      cache_dtype: the key/value cache's dtype (another than float32 goes to
        ``init_cache(..., dtype=)``).
    """
    b, t = prompt.shape
    # the contract is init_cache(batch, length), float32: a dtype goes only where it differs
    dtype = {} if jnp.dtype(cache_dtype) == jnp.float32 else {"dtype": cache_dtype}
    cache = model.init_cache(b, t + new, **dtype)
    kw = {} if pads is None else {"pads": pads}
    logits, cache = model.decode(prompt, cache, 0, **kw)
    keys = jax.random.split(key, new)

    def running(carry):  # tokens left, and a row that has not drawn a stop id
        return (carry[0] < new) & ~carry[4].all()

    def step(carry):
        i, last, cache, out, done = carry
        token = pick(last, keys[i], temperature=temperature, top_p=top_p).astype(prompt.dtype)
        done = done | jnp.isin(token, stop)
        logits, cache = model.decode(token[:, None], cache, t + i, **kw)
        return i + 1, logits[:, -1], cache, out.at[:, i].set(token), done

    out = jnp.full((b, new), -1, prompt.dtype)
    start = (jnp.int32(0), logits[:, -1], cache, out, jnp.zeros((b,), bool))
    return jax.lax.while_loop(running, step, start)[3]


@functools.partial(jax.jit, static_argnames=("graphdef", "new", "temperature", "top_p"))
def _generate(graphdef, params, prompt, pads, key, stop, *, new: int, temperature: float,
              top_p: float):
    return decode_tokens(nnx.merge(graphdef, params), prompt, pads, key, stop, new=new,
                         temperature=temperature, top_p=top_p)


def generate(model: nnx.Module, prompt: np.ndarray, *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, key: jax.Array,
             stop: Sequence[int] = (), option: str = "--max-new-tokens",
             lengths: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """``max_new_tokens`` tokens after each row of ``prompt`` ``[B, T]`` (int), ``[B, N]``.

    Args:
      model: a model with ``init_cache(batch, length)`` and ``decode(tokens, cache, start)``
        (:class:`zjax.models.GPT`, :class:`zjax.models.Llama`).
      key: the RNG key of the draws (token ``i`` of every row draws with the ``i``-th of
        ``max_new_tokens`` keys split from it, stops or not).
      stop: ids that end a row, as transformers' ``eos_token_id``: generation ends once every
        row has drawn one; the positions after that are -1 (cut each row at its first stop id
        with :func:`until_stop`).
      option: the setting ``max_new_tokens`` came from, named by the error when the prompt
        and the new tokens exceed the model's ``max_seq_len``.
      lengths: prompts of different lengths, left-padded to ``T``: each row's true length
        (its tokens at the row's end; ``decode`` gets ``pads = T - lengths``). Each row then
        decodes as its prompt alone would. None: every row is ``T`` tokens.

    Raises:
      ConfigError: the prompt and the new tokens exceed the model's ``max_seq_len``.
      ArgumentError: ``lengths`` is not one length in 1..T per row.
    """
    b, t = prompt.shape
    limit = model.cfg.max_seq_len
    if t + max_new_tokens > limit:
        raise ConfigError(f"{option}: a prompt of {t} tokens and "
                          f"{max_new_tokens} new ones exceed the model's max_seq_len {limit}")
    pads = None if lengths is None else jnp.asarray(t - _lengths(lengths, b, t), jnp.int32)
    graphdef, params = nnx.split(model)
    stop_ids = jnp.asarray(sorted({int(i) for i in stop}) or [-1], jnp.int32)
    return np.asarray(_generate(graphdef, params, jnp.asarray(prompt, jnp.int32), pads, key,
                                stop_ids, new=max_new_tokens, temperature=float(temperature),
                                top_p=float(top_p)))


def _lengths(lengths: Sequence[int] | np.ndarray, rows: int, width: int) -> np.ndarray:
    """``lengths`` as ints ``[rows]``, each in 1..``width``, or an ArgumentError."""
    out = np.asarray(lengths).reshape(-1)
    if np.asarray(lengths).ndim != 1 or len(out) != rows:
        raise ArgumentError("lengths", f"one length per prompt row ({rows}) expected, got "
                            f"shape {np.shape(lengths)}")
    if out.size and (not np.issubdtype(out.dtype, np.integer) or out.min() < 1
                     or out.max() > width):
        raise ArgumentError("lengths", f"each must be an integer in 1..{width} (the padded "
                            f"prompt's length), got {out.tolist()}")
    return out.astype(np.int64)


def until_stop(row: Sequence[int], stop: Sequence[int] | set[int]) -> list[int]:
    """``row`` up to (not including) its first id in ``stop``, without the -1 of positions
    never generated."""
    out = []
    for token in (int(t) for t in row):
        if token in stop or token < 0:
            break
        out.append(token)
    return out
