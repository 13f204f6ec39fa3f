"""Train the reference GPT from a :class:`~zjax.config.Config`: the loop, logging and eval."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from zjax.config import Config
from zjax.data import VOCAB_SIZE, load_text
from zjax.errors import ConfigError
from zjax.mesh import make_mesh
from zjax.models.gpt import GPT, lm_loss
from zjax.optim import make_optimizer
from zjax.step import TrainState, make_step
from zjax.trainable import from_nnx

__all__ = ["TrainResult", "train_gpt"]

log = logging.getLogger("zjax")


@dataclasses.dataclass
class TrainResult:
    """The final state and the logged metrics (one dict per logged step)."""

    state: TrainState
    history: list[dict]


def train_gpt(config: Config, *, on_log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train the reference GPT on byte-level text as ``config`` says.

    Args:
      config: the experiment.
      on_log: called with each logged metrics dict (default: log a line).
    """
    if config.model.vocab_size < VOCAB_SIZE:
        raise ConfigError(
            f"model.vocab_size: {config.model.vocab_size} is smaller than the {VOCAB_SIZE} "
            "byte values of the text data"
        )
    mesh = make_mesh(config.mesh)
    data = load_text(config.data.path, eval_fraction=config.data.eval_fraction)
    trainable = from_nnx(lambda rngs: GPT(config.model, rngs=rngs), lm_loss)
    tx = make_optimizer(config.optimizer, total_steps=config.train.steps)
    zstep = make_step(trainable, tx, zero=config.zero, mesh=mesh,
                      micro_batches=config.train.grad_accum)
    log.info("%s", zstep.plan.summary(opt_state=zstep.abstract_state.opt_state, tx=tx))
    state = zstep.init(jax.random.key(config.train.seed))
    put = zstep.put_batch
    put(np.zeros((config.data.batch_size, 1), np.int32))  # fail fast on an indivisible batch
    train_batches = data.batches(batch_size=config.data.batch_size, seq_len=config.data.seq_len,
                                 seed=config.train.seed)
    eval_batches = None
    if config.train.eval_every and len(data.eval) > config.data.seq_len + 1:
        eval_batches = data.batches(batch_size=config.data.batch_size,
                                    seq_len=config.data.seq_len, seed=config.train.seed,
                                    split="eval")
    emit = on_log or (lambda m: log.info(
        "step %5d | loss %.4f%s | %8.0f tok/s", m["step"], m["loss"],
        f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else "", m["tokens_per_s"]))
    history, t0, tokens = [], time.perf_counter(), 0
    for i in range(config.train.steps):
        state, metrics = zstep.step(state, put(next(train_batches)))
        tokens += config.data.batch_size * config.data.seq_len
        step = i + 1
        if step % config.train.log_every == 0 or step == config.train.steps:
            loss = float(metrics["loss"])  # blocks: the timing below covers finished steps
            dt = time.perf_counter() - t0
            row = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                   "tokens_per_s": tokens / dt}
            if eval_batches is not None and (
                step % config.train.eval_every == 0 or step == config.train.steps
            ):
                row["eval_loss"] = float(np.mean(
                    [zstep.evaluate(state.params, put(next(eval_batches))) for _ in range(2)]
                ))
            history.append(row)
            emit(row)
            t0, tokens = time.perf_counter(), 0
    return TrainResult(state, history)
