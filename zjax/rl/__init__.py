"""Reinforcement learning with verifiable rewards: the ``rl`` section, GRPO's advantages and
clipped policy loss (TRL's three averagings), and reward functions with TRL's signature
(loaded by name, their answers checked; the built-ins ``exact_answer`` and
``format_reward``).

It owns the ``rl`` section (``zjax.rl.config``, light) and imports ``zjax.errors`` and
``zjax.schema`` (and JAX for the loss); the rest loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.rl.config import LOSSES, RLConfig

_LAZY = {
    "TokenLoss": "zjax.rl._losses",
    "group_advantages": "zjax.rl._losses",
    "policy_loss": "zjax.rl._losses",
    "RewardError": "zjax.rl._rewards",
    "Rewards": "zjax.rl._rewards",
    "exact_answer": "zjax.rl._rewards",
    "format_reward": "zjax.rl._rewards",
    "load_reward": "zjax.rl._rewards",
}

__all__ = [
    "LOSSES",
    "RLConfig",
    "RewardError",
    "Rewards",
    "TokenLoss",
    "exact_answer",
    "format_reward",
    "group_advantages",
    "load_reward",
    "policy_loss",
]

__getattr__ = exports(__name__, _LAZY)

if TYPE_CHECKING:
    from zjax.rl._losses import TokenLoss, group_advantages, policy_loss
    from zjax.rl._rewards import (
        RewardError,
        Rewards,
        exact_answer,
        format_reward,
        load_reward,
    )
