"""Reference models used by configs, tests and benchmarks.

``GPTConfig`` and ``LlamaConfig`` load without Flax (a config validates without the model);
``GPT``, ``Llama`` and ``lm_loss`` load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zjax.models._gpt_config import GPTConfig
from zjax.models._llama_config import LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "lm_loss", "model_class"]

_LAZY = {"GPT": "zjax.models.gpt", "lm_loss": "zjax.models.gpt", "Llama": "zjax.models.llama"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zjax.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def model_class(config: Any) -> type | None:
    """The reference model a ``model`` section builds (``GPT`` for a :class:`GPTConfig`,
    ``Llama`` for a :class:`LlamaConfig`); None for another loop's section."""
    name = {GPTConfig: "GPT", LlamaConfig: "Llama"}.get(type(config))
    return None if name is None else __getattr__(name)


if TYPE_CHECKING:
    from zjax.models.gpt import GPT, lm_loss
    from zjax.models.llama import Llama
