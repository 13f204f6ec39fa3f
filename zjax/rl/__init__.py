"""Reinforcement learning with verifiable rewards: the ``rl`` section, GRPO's advantages and
clipped policy loss (TRL's three averagings), and reward functions with TRL's signature
(loaded by name, their answers checked; the built-ins ``exact_answer`` and
``format_reward``).

It owns the ``rl`` section (``zjax.rl.config``, light) and imports ``zjax.models``,
``zjax.preference`` (its frozen copy), ``zjax.lora`` and the runtime; the rest loads on first
use. The model trained by GRPO (:func:`rl_trainable`) generates through its ``decoder``;
the rollout loop that drives it is the trainer's.
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
    "ADVANTAGES": "zjax.rl._objective",
    "OLD_LOGPS": "zjax.rl._objective",
    "REF_LOGPS": "zjax.rl._objective",
    "grpo_loss": "zjax.rl._objective",
    "grpo_score": "zjax.rl._objective",
    "scored_keys": "zjax.rl._objective",
    "rl_trainable": "zjax.rl._trainable",
}

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "OLD_LOGPS",
    "REF_LOGPS",
    "RLConfig",
    "RewardError",
    "Rewards",
    "TokenLoss",
    "exact_answer",
    "format_reward",
    "group_advantages",
    "grpo_loss",
    "grpo_score",
    "load_reward",
    "policy_loss",
    "rl_trainable",
    "scored_keys",
]

__getattr__ = exports(__name__, _LAZY)

if TYPE_CHECKING:
    from zjax.rl._losses import TokenLoss, group_advantages, policy_loss
    from zjax.rl._objective import (
        ADVANTAGES,
        OLD_LOGPS,
        REF_LOGPS,
        grpo_loss,
        grpo_score,
        scored_keys,
    )
    from zjax.rl._rewards import (
        RewardError,
        Rewards,
        exact_answer,
        format_reward,
        load_reward,
    )
    from zjax.rl._trainable import rl_trainable
