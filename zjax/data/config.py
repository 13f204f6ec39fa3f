"""The ``data`` config section, in a module that imports nothing heavy (no Grain): a config
is read and validated without loading the data pipeline."""

from __future__ import annotations

import dataclasses
import math
import numbers

from zjax.errors import ConfigError
from zjax.schema import choices, interval, positive, short, validate

__all__ = ["FORMATS", "DataConfig"]

FORMATS = ("text", "chat", "prompt_completion", "preference", "prompt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The ``data`` section: where tokens come from and how they are batched.

    Attributes:
      batch_size: global batch (sequences per optimizer step, over all replicas).
      seq_len: tokens per sequence (each example holds ``seq_len + 1`` for the shifted targets).
      path: where the data is, by extension: records (``.jsonl``, ``.jsonl.gz``,
        ``.jsonl.zst``, ``.parquet``, ``.arrow``, a ``datasets.save_to_disk`` directory, or a
        ``zjax tokenize`` directory) are documents, packed into windows; a text file,
        directory or glob (byte-level, or with ``data.tokenizer``) or a ``.npy`` of token ids
        is one token stream cut into windows. A list of paths is one source; a mapping
        ``{path: weight}`` mixes its sources in those proportions. Empty for the ``.py``
        files of Python's standard library.
      eval_fraction: the tail of the data held out for evaluation (documents, or tokens of a
        stream). A tail shorter than one batch is evaluated as one batch padded with rows
        that count for nothing; one with no window at all means no evaluation (a warning).
      tokenizer: a Hugging Face ``tokenizer.json``: text is tokenized with it as it is read
        (instead of byte-level), and ``model.vocab_size`` must cover its vocabulary; its
        ``tokenizer_config.json`` (beside it) gives the end-of-sequence token and the chat
        template. For large corpora tokenize once with ``zjax tokenize``. Empty for
        byte-level text.
      format: what a record holds: ``text`` (``data.text_field``), ``chat`` (a list of
        ``{role, content}`` messages in ``data.messages_field``, rendered with the
        tokenizer's chat template), ``prompt_completion`` (``prompt`` and ``completion``
        fields), ``preference`` (pairs for DPO-style training, in Hugging Face TRL's
        layouts: ``chosen`` and ``rejected`` answers, as strings or lists of messages, with
        an optional ``prompt``; without one, conversations' common prefix is the prompt).
        Each pair gives two sequences, the chosen then the rejected, each in its own row of
        ``seq_len + 1`` tokens: its prompt cut from the left to ``data.max_prompt_len``, its
        answer cut at the end to fit (counted, and said in a warning). Or ``prompt``: prompts
        to generate completions from (reinforcement learning with verifiable rewards, the
        datasets of TRL's ``GRPOTrainer``): a ``prompt`` field, text (encoded with the
        tokenizer's special tokens) or a list of messages (rendered with the chat template
        and its generation prompt), cut from the left to ``data.max_prompt_len``; the row's
        other fields are handed unchanged to the reward functions. Read with
        :func:`zjax.data.load_prompts`, never packed nor tokenized ahead.
      text_field: the column of a ``text`` record.
      messages_field: the column of a ``chat`` record's messages.
      packing: pack documents into each window (segment ids keep them apart); false gives
        each document its own window, the rest padded (and masked). Ignored by
        ``preference``, whose every sequence has its own row, and by ``prompt``.
      train_on_prompt: train on every token; by default a ``chat`` record trains only on
        its assistant turns and a ``prompt_completion`` record only on its completion.
        Refused with ``preference``, which trains on the answers only, and with
        ``prompt``, which trains on generated completions only.
      eos_token: the token that ends each ``text`` record and each completion (a token of
        ``data.tokenizer``); unset: the ``eos_token`` of its ``tokenizer_config.json``. A
        tokenizer without one (no config, or its ``eos_token`` is not in the vocabulary) is
        refused for these formats until this is set: to a token, or to ``""`` for documents
        with no end marker (packed documents are still kept apart by their segment ids).
      max_prompt_len: the tokens a ``preference`` or ``prompt`` prompt keeps: a longer one is
        cut from the left (its start dropped, TRL's ``truncation_mode="keep_end"``); below
        ``data.seq_len``. Unset: ``seq_len // 2``.
    """

    batch_size: int = positive(16)
    seq_len: int = positive(128)
    path: str | list | dict | None = None
    eval_fraction: float = interval(0, 1, default=0.05)
    tokenizer: str | None = None
    format: str = choices(*FORMATS, default="text")
    text_field: str = "text"
    messages_field: str = "messages"
    packing: bool = True
    train_on_prompt: bool = False
    eos_token: str | None = None
    max_prompt_len: int | None = positive(None, none_means="data.seq_len // 2")

    def __post_init__(self):
        validate(self, "data")
        if isinstance(self.path, list | tuple | dict):
            object.__setattr__(self, "path", _paths(self.path))
        for key in ("text_field", "messages_field"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key}: must name a field, got an empty string")
        if self.max_prompt_len is not None and self.max_prompt_len >= self.seq_len:
            raise ConfigError(f"data.max_prompt_len: {self.max_prompt_len}, but data.seq_len "
                              f"is {self.seq_len}: a prompt must leave room for its answer "
                              f"(expected < {self.seq_len})")
        if self.format == "preference" and self.train_on_prompt:
            raise ConfigError("data.train_on_prompt: true, but data.format preference trains "
                              "on the answers only (the preference loss compares the "
                              "answers' log-probabilities)")
        if self.format == "prompt" and self.train_on_prompt:
            raise ConfigError("data.train_on_prompt: true, but data.format prompt trains on "
                              "nothing of a prompt's tokens (the completions generated from "
                              "it are what is trained on)")

    @property
    def prompt_limit(self) -> int:
        """The tokens a ``preference`` or ``prompt`` prompt keeps: ``max_prompt_len``, else
        ``seq_len // 2``."""
        return self.seq_len // 2 if self.max_prompt_len is None else self.max_prompt_len

    @property
    def sources(self) -> tuple[tuple[str | list | None, float], ...]:
        """``((path or paths, weight), ...)``: one source of weight 1 unless ``path`` is a
        mapping."""
        if isinstance(self.path, dict):
            return tuple(self.path.items())
        return ((self.path, 1.0),)


def _paths(value) -> list | dict:
    """A list of paths, or a ``{path: weight}`` mapping with positive finite weights."""
    if isinstance(value, list | tuple):
        if not value:
            raise ConfigError("data.path: an empty list names no data")
        for item in value:
            if not isinstance(item, str) or not item:
                raise ConfigError(f"data.path: a list of paths holds {short(item)}; expected "
                                  "file names or globs")
        return list(value)
    if not value:
        raise ConfigError("data.path: an empty mapping names no data")
    for key, weight in value.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"data.path: the mapping's key {short(key)} is not a path")
        if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight) or weight <= 0):
            raise ConfigError(f"data.path.{key}: the mixing weight must be a number > 0, got "
                              f"{short(weight)}")
    return {k: float(w) for k, w in value.items()}
