"""The Hugging Face architectures zjax reads and writes, looked up by ``config.json`` or by
a run's loop."""

from __future__ import annotations

from typing import Any

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._gpt2 import GPT2
from zjax.hf._layout import Layout
from zjax.hf._llama import LLAMA

__all__ = ["LAYOUTS", "layout_for_hf", "layout_for_model"]

LAYOUTS = (LLAMA, GPT2)


def layout_for_hf(hf: dict[str, Any], *, source: str) -> Layout:
    """The layout of a ``config.json`` (by ``model_type`` or ``architectures``)."""
    arch = hf.get("architectures") or []
    for layout in LAYOUTS:
        if hf.get("model_type") == layout.model_type or layout.architecture in arch:
            return layout
    known = ", ".join(f"{x.model_type} ({x.architecture})" for x in LAYOUTS)
    raise CheckpointError(f"{source}: model_type {hf.get('model_type')!r} (architectures "
                          f"{arch}); zjax reads {known}")


def layout_for_model(loop: str, model: Any) -> Layout:
    """The Hugging Face layout of a run's model, or ConfigError saying why it has none."""
    for layout in LAYOUTS:
        if layout.loop == loop:
            layout.to_hf(model, dtype="float32")  # raises ConfigError for a model it cannot be
            return layout
    raise ConfigError(f"--format: hf needs a run of loop: llama (LlamaForCausalLM) or loop: "
                      f"lm with GPT-2's layout (GPT2LMHeadModel); the run is loop: {loop}")
