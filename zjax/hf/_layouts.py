"""The Hugging Face architectures zjax reads and writes, looked up by ``config.json`` or by
a run's model."""

from __future__ import annotations

from typing import Any

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from zjax.hf._families import LLAMA, MISTRAL, MIXTRAL, PHI3, QWEN2, QWEN3, QWEN3_MOE
from zjax.hf._gemma import GEMMA, GEMMA2, GEMMA3
from zjax.hf._gpt2 import GPT2
from zjax.hf._layout import Layout

__all__ = ["LAYOUTS", "layout_for_hf", "layout_for_model"]

# a run's model is exported as the first that can hold it (a Mistral without a window is a
# Llama); a run started from a Hugging Face model keeps that model's architecture
LAYOUTS = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA, GEMMA2, GEMMA3, MIXTRAL, QWEN3_MOE,
           DEEPSEEK_V3, DEEPSEEK_V2, GPT2)


def layout_for_hf(hf: dict[str, Any], *, source: str) -> Layout:
    """The layout of a ``config.json`` (by ``model_type`` or ``architectures``)."""
    arch = hf.get("architectures") or []
    for layout in LAYOUTS:
        if hf.get("model_type") == layout.model_type or layout.architecture in arch:
            return layout
    known = ", ".join(f"{x.model_type} ({x.architecture})" for x in LAYOUTS)
    raise CheckpointError(f"{source}: model_type {hf.get('model_type')!r} (architectures "
                          f"{arch}) is not supported; zjax reads {known}")


def layout_for_model(loop: str, model: Any, *, prefer: Layout | None = None) -> Layout:
    """The Hugging Face layout of a run's model (``prefer`` where it can hold the model), or
    ConfigError saying why it has none."""
    why = []
    for layout in (prefer, *LAYOUTS) if prefer is not None else LAYOUTS:
        if layout.loop != loop:
            continue
        try:
            layout.to_hf(model, dtype="float32")  # raises ConfigError for a model it cannot be
        except ConfigError as e:
            why.append(e)
            continue
        return layout
    if len(why) == 1:
        raise why[0]
    if why:
        reasons = "; ".join(dict.fromkeys(str(e) for e in why))
        raise ConfigError(f"--format: hf: no Hugging Face architecture zjax writes holds this "
                          f"model ({reasons})")
    raise ConfigError(f"--format: hf needs a run of loop: llama (Llama, Mistral, Qwen2, Qwen3, "
                      f"Phi-3, Gemma 1/2/3, Mixtral, Qwen3-MoE) or loop: lm with GPT-2's "
                      f"layout (GPT2LMHeadModel); the run is loop: {loop}")
