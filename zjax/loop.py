"""The ``Loop`` protocol a user implements, and the built-in language-model loop.

A loop says what to train; :func:`zjax.train` says how (ZeRO, mesh, optimizer, logging). It
builds the model from its ``model`` config section (an NNX module through
:func:`zjax.from_nnx`, or a params pytree and pure loss through :func:`zjax.from_pytree`), and
gives the data: an iterator of this process's slice of each global batch. A config file names
its loop: ``loop: lm`` for the built-in one, or ``package.module:Name`` for a user's.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from zjax._schema import short
from zjax.data import BYTE_VOCAB, DataConfig, Tokens, load_tokens, window_batches
from zjax.errors import ConfigError, did_you_mean, first_line
from zjax.models.gpt import GPT, GPTConfig, lm_loss
from zjax.trainable import Trainable, from_nnx

__all__ = ["BUILTIN_LOOPS", "LanguageModel", "Loop", "resolve_loop"]


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
             process_count: int) -> Iterator[np.ndarray]:
        """This process's slice of each global batch; ``get_state``/``set_state`` if it can."""
        ...


class LanguageModel:
    """The built-in loop (``loop: lm``): the reference GPT on byte-level or token data."""

    model_config = GPTConfig

    def __init__(self) -> None:
        self._tokens: dict[tuple, Tokens] = {}

    def tokens(self, data: DataConfig) -> Tokens:
        key = (data.path, data.eval_fraction)
        if key not in self._tokens:
            self._tokens[key] = load_tokens(data.path, eval_fraction=data.eval_fraction)
        return self._tokens[key]

    def trainable(self, model: GPTConfig) -> Trainable:
        return from_nnx(lambda rngs: GPT(model, rngs=rngs), lm_loss)

    def check(self, model: GPTConfig, data: DataConfig) -> None:
        """Cross-section checks: the vocabulary must cover the data's tokens."""
        vocab = self.tokens(data).vocab_size or BYTE_VOCAB
        if model.vocab_size < vocab:
            raise ConfigError(
                f"model.vocab_size: {model.vocab_size}, but {self.tokens(data).source} holds "
                f"token ids up to {vocab - 1}; set model.vocab_size to at least {vocab}"
            )

    def abstract_batch(self, data: DataConfig) -> jax.ShapeDtypeStruct:
        """The global batch's shape and dtype, without reading the data (for ``zjax plan``)."""
        return jax.ShapeDtypeStruct((data.batch_size, data.seq_len + 1), np.int32)

    def data(self, data: DataConfig, *, split: str, seed: int, process_index: int = 0,
             process_count: int = 1) -> Iterator[np.ndarray]:
        return window_batches(self.tokens(data).split(split), global_batch=data.batch_size,
                              seq_len=data.seq_len, seed=seed, process_index=process_index,
                              process_count=process_count, split=split)


BUILTIN_LOOPS = {"lm": LanguageModel}


def resolve_loop(name: str) -> Loop:
    """``lm`` or ``package.module:Name`` -> a Loop instance.

    A ``package.module:Name`` imports that module (running its code) and instantiates
    ``Name`` if it is a class; what it gives must have ``model_config`` (a dataclass),
    ``trainable()`` and ``data()``.
    """
    if not isinstance(name, str):
        raise ConfigError(f"loop: expected a name like 'lm' or 'pkg.mod:Name', got "
                          f"{short(name)} ({type(name).__name__})")
    if name in BUILTIN_LOOPS:
        return BUILTIN_LOOPS[name]()
    if ":" not in name:
        raise ConfigError(
            f"loop: {short(name)} is not a built-in loop{did_you_mean(name, BUILTIN_LOOPS)}; "
            f"use one of {', '.join(BUILTIN_LOOPS)} or 'package.module:ClassName'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises on import: one line
        why = first_line(e) or type(e).__name__
        raise ConfigError(f"loop: cannot import module {module_name!r} ({why})") from None
    try:
        cls = getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ConfigError(
            f"loop: module {module_name!r} has no {attr!r}{did_you_mean(attr, names)}"
        ) from None
    needs = "it needs model_config (a dataclass), trainable() and data()"
    missing = [a for a in ("model_config", "trainable", "data") if not hasattr(cls, a)]
    if missing:  # checked before instantiating: `loop=subprocess:Popen` must not run anything
        raise ConfigError(f"loop: {short(name)} is not a Loop ({needs}; it has no "
                          f"{', '.join(missing)})")
    if isinstance(cls, type):
        try:
            loop = cls()
        except Exception as e:  # a user's constructor: one line, naming the key
            why = first_line(e) or type(e).__name__
            raise ConfigError(f"loop: {short(name)}() failed: {why}") from None
    else:
        loop = cls
    if not isinstance(loop, Loop) or not dataclasses.is_dataclass(loop.model_config):
        raise ConfigError(f"loop: {short(name)} is not a Loop ({needs})")
    return loop
