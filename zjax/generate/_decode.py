"""KV-cached decoding: the prompt runs once (``decode`` at position 0), then each new token
attends to the cached keys and values, so a step costs one token's forward pass, not the whole
sequence's; the loop over new tokens is a ``lax.while_loop`` inside one ``jit`` that ends once
every row has drawn a stop id. Sampling is by temperature and nucleus (top-p); temperature 0
is greedy. Used by ``zjax sample`` (:mod:`zjax.export.sample`) and meant for RL rollouts: it
lies below the training run so that the trainer can call it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zjax.errors import ConfigError

__all__ = ["generate", "pick", "until_stop"]


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


@functools.partial(jax.jit, static_argnames=("graphdef", "new", "temperature", "top_p"))
def _generate(graphdef, params, prompt, key, stop, *, new: int, temperature: float,
              top_p: float):
    model = nnx.merge(graphdef, params)
    b, t = prompt.shape
    cache = model.init_cache(b, t + new)
    logits, cache = model.decode(prompt, cache, 0)
    keys = jax.random.split(key, new)

    def running(carry):  # tokens left, and a row that has not drawn a stop id
        return (carry[0] < new) & ~carry[4].all()

    def step(carry):
        i, last, cache, out, done = carry
        token = pick(last, keys[i], temperature=temperature, top_p=top_p).astype(prompt.dtype)
        done = done | jnp.isin(token, stop)
        logits, cache = model.decode(token[:, None], cache, t + i)
        return i + 1, logits[:, -1], cache, out.at[:, i].set(token), done

    out = jnp.full((b, new), -1, prompt.dtype)
    start = (jnp.int32(0), logits[:, -1], cache, out, jnp.zeros((b,), bool))
    return jax.lax.while_loop(running, step, start)[3]


def generate(model: nnx.Module, prompt: np.ndarray, *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, key: jax.Array,
             stop: Sequence[int] = (), option: str = "--max-new-tokens") -> np.ndarray:
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
    """
    limit = model.cfg.max_seq_len
    if prompt.shape[1] + max_new_tokens > limit:
        raise ConfigError(f"{option}: a prompt of {prompt.shape[1]} tokens and "
                          f"{max_new_tokens} new ones exceed the model's max_seq_len {limit}")
    graphdef, params = nnx.split(model)
    stop_ids = jnp.asarray(sorted({int(i) for i in stop}) or [-1], jnp.int32)
    return np.asarray(_generate(graphdef, params, jnp.asarray(prompt, jnp.int32), key,
                                stop_ids, new=max_new_tokens, temperature=float(temperature),
                                top_p=float(top_p)))


def until_stop(row: Sequence[int], stop: Sequence[int] | set[int]) -> list[int]:
    """``row`` up to (not including) its first id in ``stop``, without the -1 of positions
    never generated."""
    out = []
    for token in (int(t) for t in row):
        if token in stop or token < 0:
            break
        out.append(token)
    return out
