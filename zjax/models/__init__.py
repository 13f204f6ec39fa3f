"""Reference models used by configs, tests and benchmarks.

``GPTConfig`` loads without Flax (a config validates without the model); ``GPT`` and
``lm_loss`` load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zjax.models._gpt_config import GPTConfig

__all__ = ["GPT", "GPTConfig", "lm_loss"]


def __getattr__(name: str) -> Any:
    if name not in ("GPT", "lm_loss"):
        raise AttributeError(f"module 'zjax.models' has no attribute {name!r}")
    value = getattr(importlib.import_module("zjax.models.gpt"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from zjax.models.gpt import GPT, lm_loss
