"""A user's own Loop (a Linen model zjax does not own), named in configs as tests.user_loop:..."""

from __future__ import annotations

import dataclasses

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np

import zjax
from zjax.data import window_batches


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """The model section of this loop.

    Attributes:
      width: hidden width.
    """

    width: int = 32


class _LM(linen.Module):
    width: int

    @linen.compact
    def __call__(self, tokens):
        embed = linen.Embed(64, self.width, name="embed")
        h = jax.nn.gelu(linen.Dense(self.width, name="mix")(embed(tokens)))
        return embed.attend(h).astype(jnp.float32)


class CountingLoop:
    """Learn to continue a counting sequence modulo 64."""

    model_config = MLPConfig

    def trainable(self, model: MLPConfig) -> zjax.Trainable:
        return zjax.from_pytree(*self.init_and_loss(model))

    def init_and_loss(self, model: MLPConfig):
        net = _LM(model.width)

        def loss(params, batch):
            logits = net.apply({"params": params}, batch[:, :-1])
            picked = jnp.take_along_axis(logits, batch[:, 1:, None], -1)[..., 0]
            nll = jax.nn.logsumexp(logits, -1) - picked
            correct = jnp.sum(jnp.argmax(logits, -1) == batch[:, 1:])
            return jnp.sum(nll), jnp.asarray(nll.size), {"accuracy": correct}

        return lambda rng: net.init(rng, jnp.zeros((1, 4), jnp.int32))["params"], loss

    def data(self, data, *, split, seed, process_index=0, process_count=1):
        tokens = (np.arange(100_000) % 64).astype(np.int32)
        return window_batches(tokens, global_batch=data.batch_size, seq_len=data.seq_len,
                              seed=seed + (split == "eval"), process_index=process_index,
                              process_count=process_count, split=split)


class PoisonedLoop(CountingLoop):
    """CountingLoop whose batches 3 and 4 (1-based) make the loss NaN (steps 3 and 4)."""

    poisoned = (3, 4)

    def init_and_loss(self, model: MLPConfig):
        init, inner = super().init_and_loss(model)

        def loss(params, batch):
            total, count, extra = inner(params, jnp.abs(batch))
            return jnp.where(jnp.any(batch < 0), jnp.nan, total), count, extra

        return init, loss

    def data(self, data, *, split, seed, process_index=0, process_count=1):
        it = super().data(data, split=split, seed=seed, process_index=process_index,
                          process_count=process_count)
        for i, batch in enumerate(it, 1):
            yield -batch - 1 if split == "train" and i in self.poisoned else batch
