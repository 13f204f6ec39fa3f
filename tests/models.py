"""Small models shared by the tests: the reference GPT and Llama (NNX) and a Linen LM."""

from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zjax
from zjax.models import GPT, GPTConfig, Llama, LlamaConfig, lm_loss

TINY = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, d_ff=64, max_seq_len=16,
                 tie_embeddings=True)


def gpt_trainable(cfg: GPTConfig = TINY) -> zjax.Trainable:
    return zjax.from_nnx(lambda rngs: GPT(cfg, rngs=rngs), lm_loss)


def gpt_reference_loss(cfg: GPTConfig = TINY):
    """``loss(params, batch)`` on the plain (unsharded) model, params as a pure dict."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    return lambda params, batch: lm_loss(nnx.merge(graphdef, params), batch)


# grouped-query attention (2 query heads per key/value head), untied head; model = 1, 2 divide
# the key/value heads; d_ff 96 divides by 8 and 2
TINY_LLAMA = LlamaConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                         d_ff=96, max_seq_len=16)


def llama_trainable(cfg: LlamaConfig = TINY_LLAMA) -> zjax.Trainable:
    return zjax.from_nnx(lambda rngs: Llama(cfg, rngs=rngs), lm_loss)


def llama_reference_loss(cfg: LlamaConfig = TINY_LLAMA):
    """``loss(params, batch)`` on the plain (unsharded) Llama, params as a pure dict."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    return lambda params, batch: lm_loss(nnx.merge(graphdef, params), batch)


def token_batches(n: int, *, batch: int = 16, seq: int = 16, vocab: int = 64, seed: int = 0):
    """Deterministic batches with some structure (a noisy counting sequence) to learn."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, vocab, (batch, 1))
        seqs = (start + np.arange(seq + 1)) % vocab
        noise = rng.random(seqs.shape) < 0.1
        seqs = np.where(noise, rng.integers(0, vocab, seqs.shape), seqs)
        out.append(seqs.astype(np.int32))
    return out


class LinenLM(linen.Module):
    """A Linen language model zjax does not own: tied embedding, two MLP blocks."""

    vocab: int = 64
    d: int = 32

    @linen.compact
    def __call__(self, tokens):
        embed = linen.Embed(self.vocab, self.d, name="embed")
        h = embed(tokens)
        for i in range(2):
            y = linen.LayerNorm(name=f"ln{i}")(h)
            y = linen.Dense(4 * self.d, name=f"up{i}")(y)
            h = h + linen.Dense(self.d, name=f"down{i}")(jax.nn.gelu(y))
        return embed.attend(h).astype(jnp.float32)


def linen_trainable(model: LinenLM | None = None):
    model = model or LinenLM()

    def init(rng):
        return model.init(rng, jnp.zeros((1, 16), jnp.int32))["params"]

    def loss(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(logz - picked), jnp.asarray(picked.size, jnp.float32)

    return zjax.from_pytree(init, loss), init, loss
