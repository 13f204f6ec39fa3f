"""How a Hugging Face architecture's tensors make zjax's params: the ``Layout`` record.

A :class:`Layout` names the zjax loop whose model it fills, maps ``config.json`` to that
model's config section and back, and lists the :class:`Leaf` rules: which Hugging Face tensor
(per layer for a ``Stack``'s leaves), transposed or not, and which part of a fused tensor
(GPT-2's ``c_attn`` holds q, k and v side by side). Architectures: ``_llama.LLAMA``,
``_gpt2.GPT2``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from zjax.errors import CheckpointError, ConfigError

__all__ = ["Layout", "Leaf", "check_fixed", "hf_shape", "layout_for_hf", "layout_for_model"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One zjax params leaf and the Hugging Face tensor(s) it is made of.

    Attributes:
      keys: the leaf's path in zjax's params.
      hf: the Hugging Face name, with ``{i}`` for the layer when the leaf is stacked.
      transpose: the file holds the transpose (``nn.Linear``'s ``[out, in]``).
      part: ``(k, n)``: the leaf is the k-th of n equal parts of the tensor along zjax's last
        axis (a fused projection); None for the whole tensor.
    """

    keys: tuple[str, ...]
    hf: str
    transpose: bool
    part: tuple[int, int] | None = None

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def names(self, n_layers: int) -> list[str]:
        return [self.hf.format(i=i) for i in range(n_layers)] if self.stacked else [self.hf]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A Hugging Face architecture as zjax reads and writes it.

    Attributes:
      architecture: ``config.json``'s ``architectures`` entry (``LlamaForCausalLM``).
      model_type: ``config.json``'s ``model_type``.
      loop: the zjax loop whose model holds the weights (``llama``, ``lm``).
      from_hf: ``(config.json dict, source, max_seq_len) -> model config``.
      to_hf: ``(model config, dtype name) -> config.json dict``.
      leaves: ``model config -> [Leaf]``.
      free: model config fields the weights do not fix (they may differ from the file's).
      ignored: suffixes of tensors some checkpoints hold that are not weights (buffers).
      prefix: a prefix some checkpoints leave out of every name (GPT-2's ``transformer.``).
    """

    architecture: str
    model_type: str
    loop: str
    from_hf: Callable[..., Any]
    to_hf: Callable[..., dict]
    leaves: Callable[[Any], list[Leaf]]
    free: tuple[str, ...] = ("remat",)
    ignored: tuple[str, ...] = ()
    prefix: str = ""


def _layouts() -> list[Layout]:
    from zjax.hf._gpt2 import GPT2
    from zjax.hf._llama import LLAMA

    return [LLAMA, GPT2]


def layout_for_hf(hf: dict[str, Any], *, source: str) -> Layout:
    """The layout of a ``config.json`` (by ``model_type`` or ``architectures``)."""
    arch = hf.get("architectures") or []
    for layout in _layouts():
        if hf.get("model_type") == layout.model_type or layout.architecture in arch:
            return layout
    known = ", ".join(f"{x.model_type} ({x.architecture})" for x in _layouts())
    raise CheckpointError(f"{source}: model_type {hf.get('model_type')!r} (architectures "
                          f"{arch}); zjax reads {known}")


def layout_for_model(loop: str, model: Any) -> Layout:
    """The Hugging Face layout of a run's model, or ConfigError saying why it has none."""
    for layout in _layouts():
        if layout.loop == loop:
            layout.to_hf(model, dtype="float32")  # raises ConfigError for a model it cannot be
            return layout
    raise ConfigError(f"--format: hf needs a run of loop: llama (LlamaForCausalLM) or loop: "
                      f"lm with GPT-2's layout (GPT2LMHeadModel); the run is loop: {loop}")


def check_fixed(hf: dict[str, Any], fixed: dict[str, tuple], *, source: str) -> None:
    """Refuse ``config.json`` keys whose value zjax's model cannot honour."""
    for key, ok in fixed.items():
        if hf.get(key) not in ok:
            raise CheckpointError(f"{source}: {key} = {hf.get(key)!r} is not supported by zjax "
                                  f"(it supports {' or '.join(map(repr, ok))})")


def hf_shape(leaf: Leaf, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one Hugging Face tensor of ``leaf`` (of zjax shape ``shape``)."""
    one = list(shape[1:] if leaf.stacked else shape)
    if leaf.part is not None:
        one[-1] *= leaf.part[1]
    return tuple(reversed(one)) if leaf.transpose else tuple(one)
