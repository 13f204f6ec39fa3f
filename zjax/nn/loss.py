"""Cross-entropy through the LM head without ``[tokens, vocab]`` float32 logits.

``chunked_cross_entropy(h, w, targets)`` is ``logsumexp(h @ w) - (h @ w)[target]`` per token,
computed ``chunk`` tokens at a time with its own backward: the forward keeps only each token's
log-sum-exp, the backward recomputes a chunk's logits, turns them into ``softmax - onehot``
and adds that chunk's share of the head's gradient (float32) before the next. The largest
temporary is one chunk's ``[chunk, vocab]`` float32 logits, whatever the number of tokens.
With ``softcap`` (Gemma 2's final logit soft-capping) the logits are ``c * tanh(z / c)`` of the
head's ``z``, and the backward multiplies by the tanh's derivative.

Summing the head's gradient over token chunks holds a float32 ``[D, vocab]`` buffer beside
each chunk's share: at a trillion-parameter width (20480 x 128256) 10.5 GB, where a
device's 4096 tokens' float32 logits are 2.1 GB. Where a device has fewer tokens than the
vocabulary has entries and that buffer outweighs the saving, the backward goes over slices
of the vocabulary instead (the forward's log-sum-exp gives each slice its probabilities):
each slice's gradient is written once in the head's dtype, and only the hidden states'
gradient (``tokens x D``, float32) is summed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn._wire import varying_zeros
from zjax.nn.mlp import divisor_slices

__all__ = ["chunked_cross_entropy"]


def _chunks(x, n: int, size: int):
    return x.reshape(n, size, *x.shape[1:])


def _logits(hc, w, softcap, temperature: float = 1.0):
    """A chunk's float32 logits and their derivative by the head's output (1 without a cap
    or temperature)."""
    z = jnp.dot(hc, w, preferred_element_type=jnp.float32)
    if softcap is None:
        logits, slope = z, 1.0
    else:
        t = jnp.tanh(z / softcap)
        logits, slope = softcap * t, 1 - t * t
    if temperature == 1.0:
        return logits, slope
    return logits / temperature, slope / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ce(h, w, targets, chunk: int, softcap, temperature):
    return _ce_fwd(h, w, targets, chunk, softcap, temperature)[0]


def _ce_fwd(h, w, targets, chunk: int, softcap, temperature):
    n = h.shape[0] // chunk

    def one(args):
        hc, tc = args
        logits, _ = _logits(hc, w, softcap, temperature)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return lse - picked, lse

    losses, lse = lax.map(one, (_chunks(h, n, chunk), _chunks(targets, n, chunk)))
    return losses.reshape(-1), (h, w, targets, lse.reshape(-1))


def _vocab_pieces(tokens: int, d: int, vocab: int, chunk: int, w_bytes: int) -> int:
    """Slices of the vocabulary the backward goes over (0: token chunks), estimated to hold
    less: token chunks a float32 ``[D, vocab]`` sum and its chunk's share beside a chunk's
    logits (three ``[chunk, vocab]`` float32 tensors); slices a float32 ``[tokens, D]`` sum,
    a slice's copy of the head and its gradient, and a slice's logits. A slice holds about
    as many logits as a chunk (the fewest dividing the vocabulary)."""
    if tokens >= vocab:
        return 0
    pieces = divisor_slices(tokens, vocab, chunk)
    if pieces > 2 * -(-tokens // chunk):  # no divisor near (a prime vocabulary): slivers
        return 0
    width = vocab // pieces
    by_tokens = 8 * d * vocab + 12 * min(chunk, tokens) * vocab
    by_vocab = 4 * tokens * d + 2 * d * width * w_bytes + 12 * tokens * width
    return pieces if by_vocab < by_tokens else 0


def _ce_bwd(chunk: int, softcap, temperature, res, g):
    h, w, targets, lse = res
    pieces = _vocab_pieces(h.shape[0], h.shape[1], w.shape[1], chunk, w.dtype.itemsize)
    if pieces:
        return _ce_bwd_by_vocab(pieces, softcap, temperature, res, g)
    n = h.shape[0] // chunk

    def one(dw, args):
        hc, tc, lc, gc = args
        logits, slope = _logits(hc, w, softcap, temperature)
        p = jnp.exp(logits - lc[:, None])
        onehot = jax.nn.one_hot(tc, w.shape[1], dtype=p.dtype)
        dlogits = (p - onehot) * gc[:, None] * slope
        dh = jnp.dot(dlogits.astype(w.dtype), w.T, preferred_element_type=jnp.float32)
        dw = dw + jnp.dot(hc.T, dlogits.astype(hc.dtype), preferred_element_type=jnp.float32)
        return dw, dh.astype(h.dtype)

    dw, dh = lax.scan(one, jnp.zeros(w.shape, jnp.float32),
                      (_chunks(h, n, chunk), _chunks(targets, n, chunk), _chunks(lse, n, chunk),
                       _chunks(g.astype(jnp.float32), n, chunk)))
    return dh.reshape(h.shape), dw.astype(w.dtype), None


def _ce_bwd_by_vocab(pieces: int, softcap, temperature, res, g):
    h, w, targets, lse = res
    width = w.shape[1] // pieces
    gf = g.astype(jnp.float32)

    def one(j, carry):
        dh, dw = carry
        wj = lax.dynamic_slice_in_dim(w, j * width, width, axis=1)
        logits, slope = _logits(h, wj, softcap, temperature)  # [tokens, width]
        p = jnp.exp(logits - lse[:, None])
        onehot = (targets[:, None] == j * width + jnp.arange(width)).astype(p.dtype)
        dlogits = (p - onehot) * gf[:, None] * slope
        dh = dh + jnp.dot(dlogits.astype(w.dtype), wj.T, preferred_element_type=jnp.float32)
        dwj = jnp.dot(h.T, dlogits.astype(h.dtype), preferred_element_type=jnp.float32)
        return dh, lax.dynamic_update_slice_in_dim(dw, dwj.astype(w.dtype), j * width, axis=1)

    init = (varying_zeros(h.shape, jnp.float32, h, w, g),
            varying_zeros(w.shape, w.dtype, h, w, g))
    dh, dw = lax.fori_loop(0, pieces, one, init)
    return dh.astype(h.dtype), dw, None


_ce.defvjp(_ce_fwd, _ce_bwd)


def chunked_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, *,
                          chunk: int = 1024, softcap: float | None = None,
                          temperature: float = 1.0) -> jax.Array:
    """Per-token ``-log softmax(h @ w)[target]`` in float32, ``chunk`` tokens at a time.

    Args:
      h: ``[..., D]`` final hidden states (any leading shape).
      w: ``[D, V]`` the LM head (a tied embedding's transpose is fine).
      targets: int ``[...]``, ``h``'s leading shape.
      chunk: tokens per chunk (clipped to the count; the count is padded to it).
      softcap: the logits are ``softcap * tanh((h @ w) / softcap)`` (None: ``h @ w``).
      temperature: the logits are divided by it after the cap (RL's log-probs of tokens
        sampled at that temperature).

    Returns:
      ``[...]`` float32 losses. Gradients flow to ``h`` and ``w`` (not ``targets``).
    """
    lead = targets.shape
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1).astype(jnp.int32)
    count = flat_t.shape[0]
    size = min(chunk, count)
    padded = -(-count // size) * size
    if padded != count:  # padding tokens' losses are computed and dropped
        flat_h = jnp.pad(flat_h, ((0, padded - count), (0, 0)))
        flat_t = jnp.pad(flat_t, (0, padded - count))
    return _ce(flat_h, w, flat_t, size, softcap, float(temperature))[:count].reshape(lead)
