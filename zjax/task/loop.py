"""The ``Loop`` protocol a user implements, and the built-in language-model loop.

A loop says what to train; :func:`zjax.train` says how (ZeRO, mesh, optimizer, logging). It
builds the model from its ``model`` config section (an NNX module through
:func:`zjax.from_nnx`, or a params pytree and pure loss through :func:`zjax.from_pytree`), and
gives the data: an iterator of this process's slice of each global batch. A config file names
its loop: ``loop: lm`` for the built-in one, or ``package.module:Name`` for a user's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from zjax.config import NEEDS, find_loop
from zjax.data import (
    BYTE_VOCAB,
    Corpus,
    DataConfig,
    Tokens,
    abstract_documents_batch,
    document_batches,
    load_corpus,
    load_tokens,
    preference_batches,
    preference_rows,
    uses_documents,
    window_batches,
)
from zjax.errors import ConfigError, first_line
from zjax.lora import LoraConfig
from zjax.models import with_adapters
from zjax.models.gpt import GPT, GPTConfig, lm_loss
from zjax.models.llama import Llama, LlamaConfig
from zjax.models.trainable import Trainable, from_nnx
from zjax.preference import PreferenceConfig, preference_trainable
from zjax.rl import RLConfig, rl_trainable
from zjax.schema import short

__all__ = ["LanguageModel", "LlamaLanguageModel", "Loop", "resolve_loop"]


@runtime_checkable
class Loop(Protocol):
    """What a user implements to train their own model with ``zjax.train``.

    Attributes:
      model_config: the dataclass that validates the config's ``model`` section.
    """

    model_config: type

    def trainable(self, model: Any) -> Trainable:
        """The model and its per-replica loss (``(loss_sum, count)`` or with a metrics dict)."""
        ...

    def data(self, data: DataConfig, *, split: str, seed: int, process_index: int,
             process_count: int) -> Iterator[np.ndarray] | None:
        """This process's slice of each global batch; ``get_state``/``set_state`` if it can.

        For ``split="eval"``, None means there is nothing to evaluate on: the run goes on
        without evaluation (say why in a warning)."""
        ...


class LanguageModel:
    """The built-in loop (``loop: lm``): the reference GPT on byte-level or token data.

    Args:
      source: a Python dataset to train on instead of ``data.path``: a ``datasets.Dataset``,
        a grain data source or a list of records, read as ``data.format`` says.
    """

    model_config = GPTConfig
    model_class: type = GPT

    def __init__(self, source: Any = None) -> None:
        self.source = source
        self._tokens: dict[str, Tokens | Corpus] = {}

    def documents(self, data: DataConfig) -> bool:
        """Whether the data are documents (packed windows) rather than one token stream."""
        return self.source is not None or uses_documents(data)

    def tokens(self, data: DataConfig) -> Tokens | Corpus:
        """The data's tokens (read once per distinct source)."""
        key = repr((data.path, data.tokenizer, data.format, data.text_field,
                    data.messages_field, data.train_on_prompt, data.eval_fraction,
                    data.seq_len, data.max_prompt_len))
        if key not in self._tokens:  # the files are looked at only here
            self._tokens[key] = (load_corpus(data, self.source) if self.documents(data)
                                 else load_tokens(data.path, eval_fraction=data.eval_fraction,
                                                  tokenizer=data.tokenizer))
        return self._tokens[key]

    def trainable(self, model: GPTConfig, *, lora: LoraConfig | None = None,
                  preference: PreferenceConfig | None = None, rl: RLConfig | None = None,
                  reference_dtype: str = "bfloat16") -> Trainable:
        """The model; with ``lora`` enabled, its adapters trained over the frozen base; with
        a ``preference`` method, trained on that loss, with an ``rl`` method on GRPO's (the
        reference copy, if it has one, stored in ``reference_dtype``)."""
        cls = self.model_class
        adapters = lora is not None and lora.enabled
        make = (lambda rngs: cls(model, rngs=rngs, lora=lora)) if adapters \
            else (lambda rngs: cls(model, rngs=rngs))
        if preference is not None and preference.enabled:
            return preference_trainable(make, preference, lora=lora if adapters else None,
                                        linear_weights=cls.LINEAR_WEIGHTS,
                                        reference_dtype=reference_dtype)
        if rl is not None and rl.enabled:
            return rl_trainable(make, rl, lora=lora if adapters else None,
                                linear_weights=cls.LINEAR_WEIGHTS,
                                reference_dtype=reference_dtype)
        if not adapters:
            return from_nnx(make, lm_loss)
        return with_adapters(from_nnx(make, lm_loss), lora, names=cls.LINEAR_WEIGHTS)

    def check(self, model: GPTConfig, data: DataConfig) -> None:
        """Cross-section checks: the vocabulary must cover the data's tokens (a GRPO run's
        prompts are checked when they are read)."""
        if data.format == "prompt":
            return
        tokens = self.tokens(data)
        vocab = tokens.vocab_size or BYTE_VOCAB
        if model.vocab_size < vocab:
            raise ConfigError(
                f"model.vocab_size: {model.vocab_size}, but {tokens.source} holds "
                f"token ids up to {vocab - 1}; set model.vocab_size to at least {vocab}"
            )

    def abstract_batch(self, data: DataConfig) -> Any:
        """The global batch's shapes and dtypes, without reading the data (for ``zjax plan``)."""
        if self.source is not None or uses_documents(data, read=False):
            return abstract_documents_batch(data)
        return jax.ShapeDtypeStruct((data.batch_size, data.seq_len + 1), np.int32)

    def data(self, data: DataConfig, *, split: str, seed: int, process_index: int = 0,
             process_count: int = 1, ref_logps: tuple | None = None
             ) -> Iterator[Any] | None:
        """This process's batches of ``split``: a short eval split is one padded batch,
        masked; an empty one is None (no evaluation, one warning). Preference pairs
        (``data.format: preference``) come as interleaved rows, with ``ref_logps`` (each
        of the split's documents' precomputed reference log-prob, per source) where
        given."""
        shard = dict(split=split, seed=seed, process_index=process_index,
                     process_count=process_count)
        tokens = self.tokens(data)
        if data.format == "preference":
            return preference_batches(tokens, data, ref_logps=ref_logps, **shard)
        if isinstance(tokens, Corpus):
            return document_batches(tokens, data, **shard)
        return window_batches(tokens.split(split), global_batch=data.batch_size,
                              seq_len=data.seq_len, **shard)

    def preference_rows(self, data: DataConfig, *, split: str = "train") -> Any:
        """``split``'s preference rows in order (what a reference is precomputed on):
        :func:`zjax.data.preference_rows`."""
        return preference_rows(self.tokens(data), data, split=split)


class LlamaLanguageModel(LanguageModel):
    """The built-in ``loop: llama``: the reference Llama on the same data as ``lm``."""

    model_config = LlamaConfig
    model_class = Llama


def resolve_loop(name: str) -> Loop:
    """``lm`` or ``package.module:Name`` -> a Loop instance.

    A ``package.module:Name`` imports that module (running its code) and instantiates
    ``Name`` if it is a class; what it gives must have ``model_config`` (a dataclass),
    ``trainable()`` and ``data()`` (:func:`zjax.config._loop_name.find_loop` checks the name).
    """
    found = find_loop(name)
    if isinstance(found, type):
        try:
            loop = found()
        except Exception as e:  # a user's constructor: one line, naming the key
            why = first_line(e) or type(e).__name__
            raise ConfigError(f"loop: {short(name)}() failed: {why}") from None
    else:
        loop = found
    if not isinstance(loop, Loop) or not dataclasses.is_dataclass(loop.model_config):
        raise ConfigError(f"loop: {short(name)} is not a Loop ({NEEDS})")
    return loop
