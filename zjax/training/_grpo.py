"""A GRPO run's data: the prompts, the reward functions and the rollout batches
(:mod:`zjax.training._rollouts`), checked against the run's sections before anything is
compiled; and the hook that logs the rollouts' metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zjax.data import load_prompts, prompt_batches
from zjax.errors import ConfigError
from zjax.rl import Rewards
from zjax.step import ZeroStep
from zjax.training._hooks import StepInfo
from zjax.training._rollouts import RolloutBatches

if TYPE_CHECKING:
    from zjax.config import Config

__all__ = ["RolloutMetrics", "rollout_data"]


def _check(config: Config, zstep: ZeroStep, vocab: int) -> int:
    """Prompts per rollout (all processes), after the sections' cross-checks."""
    rl, data, model = config.rl, config.data, config.model
    if data.format != "prompt":
        raise ConfigError(f"data.format: {data.format!r}, but rl.method {rl.method} samples "
                          "completions of prompts: use data.format: prompt")
    if zstep.rollout is None:
        raise ConfigError(f"rl.method: {rl.method}, but loop {config.loop!r}'s model cannot "
                          "generate (no decoder); use loop lm or llama")
    rows = data.batch_size * rl.steps_per_generation
    if rows % rl.group_size:
        raise ConfigError(f"data.batch_size: {data.batch_size} completions per step x "
                          f"rl.steps_per_generation {rl.steps_per_generation} is not a "
                          f"multiple of rl.group_size {rl.group_size} (whole groups of "
                          "completions per rollout)")
    longest = data.prompt_limit + rl.max_new_tokens
    if longest > data.seq_len + 1:
        raise ConfigError(f"data.seq_len: {data.seq_len}, but a prompt of up to "
                          f"{data.prompt_limit} tokens (data.max_prompt_len) and "
                          f"{rl.max_new_tokens} new ones (rl.max_new_tokens) need rows of "
                          f"{longest} tokens: set data.seq_len to at least {longest - 1}")
    limit = getattr(model, "max_seq_len", None)
    if limit is not None and longest > limit:
        raise ConfigError(f"rl.max_new_tokens: {rl.max_new_tokens} after prompts of up to "
                          f"{data.prompt_limit} tokens exceed model.max_seq_len {limit}")
    if getattr(model, "vocab_size", vocab) < vocab:
        raise ConfigError(f"model.vocab_size: {model.vocab_size}, but the prompts' tokenizer "
                          f"gives ids up to {vocab - 1}")
    return rows // rl.group_size


def _text(config: Config, eos: int | None) -> tuple[Callable[[list[int]], str], tuple]:
    """``(ids -> text, stop ids)``: the data's tokenizer (bytes without one); a completion
    stops at its end-of-sequence id, the chat template's special tokens and, for a Hugging
    Face model, its ``eos_token_id`` s."""
    path = config.data.tokenizer
    if path is None:
        return (lambda ids: bytes(i for i in ids if 0 <= i < 256).decode(
            "utf-8", errors="replace")), ()
    from zjax.data import load_chat_template, load_tokenizer
    from zjax.hf import stop_ids

    tokenizer = load_tokenizer(path)
    stop = {eos} if eos is not None else set()
    init_from = config.train.init_from
    if init_from is not None and (Path(init_from) / "config.json").is_file():
        stop |= set(stop_ids(init_from, tokenizer, path))
    if (Path(path).parent / "tokenizer_config.json").is_file():
        try:
            template = load_chat_template(path)
            stop |= {tokenizer.token_to_id(t) for t in template.special_tokens.values()}
        except ConfigError:  # no chat template: text prompts
            pass
    stop.discard(None)
    return (lambda ids: tokenizer.decode(list(ids))), tuple(sorted(stop))


def rollout_data(loop: Any, config: Config, zstep: ZeroStep, *, put: Callable,
                 state_of: Callable[[], Any], run_dir: Path | None,
                 process: tuple[int, int], info: Callable) -> RolloutBatches:
    """The run's rollout batches (this process's), after the checks of :func:`_check`."""
    data = config.data
    prompts = load_prompts(data, getattr(loop, "source", None))
    n_prompts = _check(config, zstep, prompts.vocab_size)
    indices = prompt_batches(prompts, data, split="train", seed=config.train.seed,
                             n_prompts=n_prompts, process_index=process[0],
                             process_count=process[1])
    if config.train.eval_every:
        info("train.eval_every: a GRPO run reports its rollouts' rewards; it evaluates no "
             "held-out loss")
    decode, stop = _text(config, prompts.eos_id)
    return RolloutBatches(zstep, config.rl, prompts, indices,
                          rewards=Rewards(config.rl.rewards, config.rl.weights),
                          state_of=state_of, put=put, decode=decode, stop=stop,
                          seq_len=data.seq_len, seed=config.train.seed, run_dir=run_dir,
                          log_every=config.train.log_every)


class RolloutMetrics:
    """A hook: a logged step's metrics get the rollout metrics (rewards, lengths, times)
    averaged over the steps since the last logged one, as TRL averages over its logging
    interval (one batch of a few prompts is a noisy figure); a logged rollout's samples are
    written once its step has run.

    Args:
      batches: the run's rollouts; ``batches.metrics`` are those of the latest.
      every: ``train.log_every``.
    """

    def __init__(self, batches: RolloutBatches, *, every: int):
        self.batches, self.every = batches, every
        self.rows: list[dict] = []

    def __call__(self, s: StepInfo) -> None:
        self.batches.flush_samples()
        self.rows.append(dict(self.batches.metrics))
        if s.step % self.every:
            return
        names = dict.fromkeys(k for row in self.rows for k in row)
        s.metrics.update({k: float(np.mean([r[k] for r in self.rows if k in r]))
                          for k in names})
        self.rows = []
