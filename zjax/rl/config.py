"""The ``rl`` config section, in a module that imports nothing heavy."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from zjax.errors import ConfigError
from zjax.schema import choices, interval, non_negative, positive, short, validate

__all__ = ["LOSSES", "RLConfig"]

LOSSES = ("grpo", "dr_grpo", "dapo")
_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The ``rl`` section: reinforcement learning with verifiable rewards (GRPO, as Hugging
    Face TRL's ``GRPOTrainer`` and DeepSeek-R1 define it) on prompts (``data.format:
    prompt``).

    Attributes:
      method: ``grpo``; empty (the default) trains next-token prediction.
      group_size: completions sampled per prompt (TRL's ``num_generations``); their rewards'
        mean (and standard deviation) is each one's baseline.
      max_new_tokens: the longest completion (TRL's ``max_completion_length``).
      temperature: the sampling temperature of the rollouts (and of the log-probs trained).
      top_p: nucleus sampling's mass (1: the whole distribution).
      kl_beta: the weight of the KL penalty against the reference (TRL's ``beta``; its k3
        estimator per token); 0 loads no reference.
      clip_epsilon: the policy ratio is clipped to ``[1 - eps, 1 + eps]`` (PPO's).
      steps_per_generation: optimizer steps per rollout batch (1: on-policy; more reuse the
        rollouts, their old log-probs computed once).
      loss: how the per-token losses are averaged: ``grpo`` (over each completion's tokens,
        then over completions), ``dr_grpo`` (their sum over completions x
        ``max_new_tokens``: Dr. GRPO's length-unbiased form), ``dapo`` (over every token of
        the global batch).
      scale_rewards: divide each advantage by its group's reward standard deviation (TRL's
        ``scale_rewards``; Dr. GRPO sets it false).
      rewards: the reward functions, as ``package.module:function``, or the built-ins
        ``zjax.rl:exact_answer`` and ``zjax.rl:format_reward``; each is called as TRL calls
        it: ``f(prompts, completions, **columns) -> list[float | None]``.
      reward_weights: one weight per reward function (default all 1); a completion's reward
        is the weighted sum of the functions' rewards, None counting as 0.
    """

    method: str | None = choices(None, "grpo", default=None)
    group_size: int = positive(8)
    max_new_tokens: int = positive(256)
    temperature: float = positive(1.0)
    top_p: float = interval(0, 1, default=1.0, closed="(]")
    kl_beta: float = non_negative(0.0)
    clip_epsilon: float = interval(0, 1, default=0.2, closed="()")
    steps_per_generation: int = positive(1)
    loss: str = choices(*LOSSES, default="dapo")
    scale_rewards: bool = True
    rewards: list = dataclasses.field(default_factory=list)
    reward_weights: list | None = None

    def __post_init__(self):
        validate(self, "rl")
        names = self.rewards
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"rl.rewards: expected a list of 'package.module:function' "
                              f"names, got {short(names)}")
        for name in names:
            if not _NAME.match(name):
                raise ConfigError(f"rl.rewards: {short(name)} is not a 'package.module:function' "
                                  "name (e.g. zjax.rl:exact_answer)")
        if self.method is not None and not names:
            raise ConfigError("rl.rewards: empty, but rl.method grpo needs reward functions "
                              "(e.g. [zjax.rl:exact_answer])")
        if self.method is not None and self.group_size < 2:
            raise ConfigError(f"rl.group_size: {self.group_size}, but a group's advantages "
                              "compare its completions: use 2 or more")
        self._check_weights()

    def _check_weights(self) -> None:
        weights = self.reward_weights
        if weights is None:
            return
        if not isinstance(weights, list | tuple) or len(weights) != len(self.rewards):
            raise ConfigError(f"rl.reward_weights: {short(weights)}, but rl.rewards names "
                              f"{len(self.rewards)} functions: give one weight each")
        for w in weights:
            if (isinstance(w, bool) or not isinstance(w, numbers.Real)
                    or not math.isfinite(w)):
                raise ConfigError(f"rl.reward_weights: {short(w)} is not a finite number")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per reward function."""
        return tuple(float(w) for w in (self.reward_weights or [1.0] * len(self.rewards)))
