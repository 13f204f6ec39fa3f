"""How a Hugging Face architecture's tensors make zjax's params: the ``Layout`` record.

A :class:`Layout` names the zjax loop whose model it fills, maps ``config.json`` to that
model's config section and back, and lists the :class:`Leaf` rules: which Hugging Face tensor
(per layer for a ``Stack``'s leaves), transposed or not, and which part of a fused tensor
(GPT-2's ``c_attn`` holds q, k and v side by side). The architectures (``_llama.LLAMA``,
``_gpt2.GPT2``) are looked up in :mod:`zjax.hf._layouts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from zjax.errors import CheckpointError

__all__ = ["Layout", "Leaf", "check_fixed", "hf_shape"]


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


def check_fixed(hf: dict[str, Any], fixed: dict[str, tuple], *, source: str) -> None:
    """Refuse ``config.json`` keys whose value zjax's model cannot honour."""
    for key, ok in fixed.items():
        if hf.get(key) not in ok:  # None in ``ok``: the key may be left out (the default)
            supported = " or ".join(repr(v) for v in ok if v is not None)
            raise CheckpointError(f"{source}: {key} = {hf.get(key)!r} is not supported by zjax "
                                  f"(it supports {supported})")


def hf_shape(leaf: Leaf, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one Hugging Face tensor of ``leaf`` (of zjax shape ``shape``)."""
    one = list(shape[1:] if leaf.stacked else shape)
    if leaf.part is not None:
        one[-1] *= leaf.part[1]
    return tuple(reversed(one)) if leaf.transpose else tuple(one)
