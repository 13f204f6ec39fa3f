"""How a Hugging Face architecture's tensors make zjax's params: the ``Layout`` record.

A :class:`Layout` names the zjax loop whose model it fills, maps ``config.json`` to that
model's config section and back, and lists the :class:`Leaf` rules: which Hugging Face tensor
(per layer for a ``Stack``'s leaves), transposed or not, and which part of a fused tensor
(GPT-2's ``c_attn`` holds q, k and v side by side). The architectures (``_llama.LLAMA``,
``_gpt2.GPT2``) are looked up in :mod:`zjax.hf._layouts`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from zjax.errors import CheckpointError

log = logging.getLogger("zjax")

__all__ = ["INERT", "REFUSED", "Layout", "Leaf", "check_fixed", "check_known", "hf_shape",
           "number"]

# config.json keys transformers reads for any architecture that change the model zjax builds
REFUSED = {"quantization_config": "quantized weights are not supported by zjax (import the "
                                  "full-precision checkpoint)",
           "auto_map": "the model's own code (trust_remote_code) defines it; zjax implements "
                       "only transformers' modelling files"}
# config.json keys that never change a decoder's computation: transformers' own bookkeeping
# (every ``PretrainedConfig`` has them), token ids, generation defaults, the initialiser
INERT = (
    "_name_or_path", "add_cross_attention", "architectures", "bad_words_ids",
    "begin_suppress_tokens", "bos_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample",
    "dtype", "early_stopping", "encoder_no_repeat_ngram_size", "eos_token_id",
    "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id",
    "length_penalty", "max_length", "min_length", "model_type", "no_repeat_ngram_size",
    "num_beam_groups", "num_beams", "num_return_sequences", "output_attentions",
    "output_hidden_states", "output_scores", "pad_token_id", "prefix", "problem_type",
    "pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict",
    "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params",
    "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p",
    "torchscript", "transformers_version", "typical_p", "use_bfloat16", "torch_dtype",
    "use_cache", "initializer_range", "cache_implementation",
)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One zjax params leaf and the Hugging Face tensor(s) it is made of.

    Attributes:
      keys: the leaf's path in zjax's params.
      hf: the Hugging Face name, with ``{i}`` for the layer when the leaf is stacked, and
        ``{e}`` for the expert when the leaf stacks a mixture's experts (its dimension after
        the layer's: one tensor per layer and expert).
      transpose: the file holds the transpose (``nn.Linear``'s ``[out, in]``).
      first: the layer index of the stack's first layer in the file (``{i}`` counts from it).
      part: ``(k, n)``: the leaf is the k-th of n equal parts of the tensor along zjax's last
        axis (a fused projection: GPT-2's ``c_attn``), or ``(k, (w0, w1, ...))``: of parts in
        those proportions (Phi-3's ``qkv_proj``: query, key, value heads); None for the whole
        tensor.
    """

    keys: tuple[str, ...]
    hf: str
    transpose: bool
    part: tuple[int, int | tuple[int, ...]] | None = None
    first: int = 0  # the file's index of the stack's first layer (DeepSeek's MoE layers)

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf

    @property
    def lead(self) -> int:
        """zjax's dimensions the file spreads over tensors: layers, then experts."""
        return int(self.stacked) + int(self.per_expert)

    def _weights(self) -> tuple[int, ...]:
        parts = self.part[1]
        return (1,) * parts if isinstance(parts, int) else tuple(parts)

    def whole(self, size: int) -> int:
        """The fused tensor's width along zjax's last axis, for this part's ``size``."""
        if self.part is None:
            return size
        weights = self._weights()
        return size * sum(weights) // weights[self.part[0]]

    def offset(self, size: int) -> int:
        """Where this part (of width ``size``) starts in the fused tensor."""
        if self.part is None:
            return 0
        weights = self._weights()
        return size * sum(weights[:self.part[0]]) // weights[self.part[0]]

    def names(self, shape: tuple[int, ...]) -> list[str]:
        """The Hugging Face tensors of the leaf of zjax shape ``shape``, in order (layer by
        layer, expert by expert)."""
        if not self.stacked:
            return [self.hf]
        experts = range(shape[1]) if self.per_expert else [0]
        return [self.hf.format(i=self.first + i, e=e) for i in range(shape[0])
                for e in experts]


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
      pinned: the fields they fix, each with why (``zjax.hf._pinned``); with ``free``, every
        field of the model config.
      ignored: suffixes of tensors some checkpoints hold that are not weights (buffers).
      unread: ``(model config, name) -> bool``: weights the model's transformers class does not
        read either (DeepSeek-V3's multi-token-prediction layers), left with a warning.
      prefix: a prefix some checkpoints leave out of every name (GPT-2's ``transformer.``).
      mapped: the ``config.json`` keys that set the model's computation (each changes it).
      bounds: keys mapped to a bound on the data, not the computation
        (``max_position_embeddings``).
    """

    architecture: str
    model_type: str
    loop: str
    from_hf: Callable[..., Any]
    to_hf: Callable[..., dict]
    leaves: Callable[[Any], list[Leaf]]
    free: tuple[str, ...] = ("remat",)
    pinned: dict[str, str] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    unread: Callable[[Any, str], bool] = lambda cfg, name: False
    prefix: str = ""
    mapped: tuple[str, ...] = ()
    bounds: tuple[str, ...] = ()


def check_fixed(hf: dict[str, Any], fixed: dict[str, tuple], *, source: str) -> None:
    """Refuse ``config.json`` keys whose value zjax's model cannot honour."""
    for key, ok in fixed.items():
        if hf.get(key) not in ok:  # None in ``ok``: the key may be left out (the default)
            supported = " or ".join(repr(v) for v in ok if v is not None)
            raise CheckpointError(f"{source}: {key} = {hf.get(key)!r} is not supported by zjax "
                                  f"(it supports {supported})")


def check_known(hf: dict[str, Any], known: tuple[str, ...], *, source: str,
                architecture: str) -> None:
    """Refuse ``config.json`` keys that change the model outside its modelling file
    (:data:`REFUSED`); name the keys that are neither ``known`` nor :data:`INERT`, which
    transformers' own model class does not read either, in a warning."""
    for key in REFUSED:  # unless the family vouches for it (DeepSeek-V3's own remote code)
        if hf.get(key) is not None and key not in known:
            raise CheckpointError(f"{source}: {key} = {hf[key]!r}: {REFUSED[key]}")
    unknown = sorted(set(hf) - set(known) - set(INERT))
    if unknown:
        log.warning("%s: %s not %s keys (its modelling file reads none of them); zjax "
                    "ignores them as transformers does and keeps them in an export",
                    source, ", ".join(unknown), architecture)


def hf_shape(leaf: Leaf, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one Hugging Face tensor of ``leaf`` (of zjax shape ``shape``)."""
    one = list(shape[leaf.lead:])
    one[-1] = leaf.whole(one[-1])
    return tuple(reversed(one)) if leaf.transpose else tuple(one)


def number(hf: dict[str, Any], key: str, kind: type, *, source: str, none: bool = False):
    """``hf[key]`` as ``kind`` (``int``, ``float`` or ``bool``), or None for a null or an
    absent key where ``none``.

    Raises:
      KeyError: ``key`` is absent and not ``none`` (the caller names what has it).
      CheckpointError: the value is not of that kind, naming the key and the value.
    """
    value = hf.get(key) if none else hf[key]
    if value is None and none:
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and (kind is float or (math.isfinite(value) and value == int(value))))
    if not ok:
        what = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise CheckpointError(f"{source}: {key} = {value!r}; expected {what}"
                              f"{' or null' if none else ''}")
    return kind(value)
