"""Prompts for reinforcement learning with verifiable rewards (``data.format: prompt``): the
datasets of Hugging Face TRL's ``GRPOTrainer``, read whole at the start of the run.

A row holds ``prompt`` and any other columns. The prompt is text, encoded with the tokenizer's
special tokens (its BOS, as ``prompt_completion`` encodes its prompt; UTF-8 bytes without
``data.tokenizer``), or a list of ``{role, content}`` messages, rendered with the tokenizer's
chat template and its generation prompt (``add_generation_prompt=True``) and encoded without
added special tokens (the template writes them). A prompt longer than ``data.max_prompt_len``
tokens (``seq_len // 2`` unset) keeps its last ones (TRL's left truncation); the prompts cut
are counted and said in one warning per source. The row's other columns are kept as read and
handed to the reward functions unchanged (TRL's ``f(prompts, completions, **columns)``, the
prompt as given: text or messages).

Refused (a ConfigError naming the file and row): a row without ``prompt`` or with a null one
(the row readers), an empty prompt (no text, no message), a prompt neither text nor a list of
messages, a message that is not ``{role, content}`` with a known role and text content, a
column named ``prompts`` or ``completions`` (the reward functions' own arguments).

The train/eval split is by prompts: the last ``int(prompts * data.eval_fraction)`` are held
out. :func:`prompt_batches` yields batches of prompt indices, shuffled every epoch from the
seed; the caller looks up their ids (:func:`left_padded`) and columns
(:func:`gather_columns`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grain
import numpy as np

from zjax.data._chat import check_messages
from zjax.data._documents import eos_id, groups
from zjax.data._records import warn_no_eval
from zjax.data._sources import object_rows, record_files, rows, source_kind
from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["PromptSet", "gather_columns", "left_padded", "load_prompts", "prompt_batches"]

FIELD = "prompt"
_EVERY = ("*",)  # the row readers' "every column"
_RESERVED = ("prompts", "completions")  # the reward functions' own arguments


@dataclasses.dataclass(frozen=True, eq=False)
class PromptSet:
    """A source's prompts, in row order.

    Attributes:
      ids: per prompt, its int32 token ids (cut from the left to ``prompt_limit``).
      prompts: per prompt, the row's ``prompt`` as read (text, or a list of messages): what
        the reward functions receive.
      columns: per prompt, the row's other columns (a dict, values as read).
      column_names: every column of ``columns`` in any row, in order of first appearance.
      n_train: the train split is prompts ``0 .. n_train``; the eval split the rest.
      vocab_size: one past the largest id the tokenizer can produce (256: bytes).
      source: the source's name (its path, or a Python source's type).
      cut: the prompts cut from the left to ``prompt_limit`` tokens.
      prompt_limit: the tokens a prompt keeps (``data.prompt_limit``).
      eos_id: the tokenizer's end-of-sequence id (``data.eos_token``, else its config's),
        None where none is known (byte-level, or no ``eos_token``).
    """

    ids: tuple[np.ndarray, ...]
    prompts: tuple[Any, ...]
    columns: tuple[dict[str, Any], ...]
    column_names: tuple[str, ...]
    n_train: int
    vocab_size: int
    source: str
    cut: int
    prompt_limit: int
    eos_id: int | None

    def __len__(self) -> int:
        return len(self.ids)

    def split(self, name: str) -> np.ndarray:
        """The int64 indices of the ``train`` or ``eval`` prompts."""
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        return np.arange(0, self.n_train) if name == "train" \
            else np.arange(self.n_train, len(self))


class _PromptEncoder:
    """Prompts to ids with ``data``'s tokenizer (bytes without one) and chat template."""

    def __init__(self, data: DataConfig):
        self.path, self.tokenizer, self.template = data.tokenizer, None, None
        self.vocab_size, self.eos_id = 256, None
        if data.tokenizer is not None:
            from zjax.data._tokenizer import id_bound, load_tokenizer

            self.tokenizer = load_tokenizer(data.tokenizer)
            self.vocab_size = id_bound(self.tokenizer)
            self.eos_id = eos_id(self.tokenizer, data)

    def encode(self, group: Sequence[tuple[str, Any]]) -> list[np.ndarray]:
        """The int32 ids of each ``(where, prompt)`` (text and messages may mix)."""
        out: list = [None] * len(group)
        texts = [i for i, (_, p) in enumerate(group) if isinstance(p, str)]
        chats = [i for i, (_, p) in enumerate(group) if not isinstance(p, str)]
        if texts:
            if self.tokenizer is None:
                encoded = [np.frombuffer(group[i][1].encode("utf-8"), np.uint8)
                           for i in texts]
            else:
                encoded = [e.ids for e in self.tokenizer.encode_batch(
                    [group[i][1] for i in texts], add_special_tokens=True)]
            for i, ids in zip(texts, encoded, strict=True):
                out[i] = np.asarray(ids, np.int32)
        if chats:
            rendered = [self._render(*group[i]) for i in chats]
            for i, e in zip(chats, self.tokenizer.encode_batch(rendered,
                                                               add_special_tokens=False),
                            strict=True):
                out[i] = np.asarray(e.ids, np.int32)
        return out

    def _render(self, where: str, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise ConfigError(f"{where}: field 'prompt' is a list of messages, which needs "
                              "data.tokenizer (a tokenizer.json with its chat template in the "
                              "tokenizer_config.json beside)")
        if self.template is None:
            from zjax.data._chat import load_chat_template

            self.template = load_chat_template(self.path, key=f"{where}: field 'prompt'")
        try:
            return self.template.render(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ConfigError(f"{where}: field 'prompt': {e}") from None


def _checked(where: str, row: dict) -> tuple[Any, dict]:
    """``(prompt, other columns)`` of a row, the prompt checked."""
    value = row[FIELD]
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: field 'prompt' is empty (no text): there is nothing "
                              "to generate a completion for")
    elif isinstance(value, list):
        check_messages(value, FIELD, where)
    else:
        raise ConfigError(f"{where}: field 'prompt' holds {type(value).__name__}, expected "
                          "text or a list of {role, content} messages")
    for name in _RESERVED:
        if name in row:
            raise ConfigError(f"{where}: field {name!r} has the name of the reward functions' "
                              "own argument (f(prompts, completions, **columns)); rename it")
    return value, {k: v for k, v in row.items() if k != FIELD}


def _source_rows(data: DataConfig, source: Any) -> tuple[Iterable[tuple[str, dict]], str]:
    """``(rows with every column, the source's name)`` of ``source`` or ``data.path``."""
    if source is not None:
        return object_rows(source, (FIELD,), optional=_EVERY), type(source).__name__
    if len(data.sources) > 1:
        raise ConfigError(f"data.path: a mapping of {len(data.sources)} weighted sources, but "
                          "data.format prompt reads one source (give several files as a "
                          "list of paths)")
    spec = data.sources[0][0]
    if spec is None:
        raise ConfigError("data.path: empty, but data.format prompt reads records (.jsonl, "
                          ".parquet, .arrow or a datasets directory) with a 'prompt' field")
    kind = source_kind(spec)
    if kind != "records":
        what = ("a zjax tokenize directory" if kind == "store"
                else "a token stream (text or .npy)")
        raise ConfigError(f"data.path: {spec!r} is {what}, but data.format prompt reads the "
                          "records themselves (.jsonl, .parquet, .arrow or a datasets "
                          "directory): the reward functions need their other columns")
    return rows(record_files(spec), (FIELD,), optional=_EVERY), str(spec)


def load_prompts(data: DataConfig, source: Any = None) -> PromptSet:
    """The prompts of ``data.path`` (or of ``source``, a Python dataset: a
    ``datasets.Dataset``, a grain source or a list of records), encoded as the module
    docstring says, every column of each row kept.

    Raises:
      ConfigError: a source that is not records, a bad row (named), a list of messages
        without ``data.tokenizer`` or its chat template, a source with no prompt.
    """
    found, name = _source_rows(data, source)
    encoder, limit = _PromptEncoder(data), data.prompt_limit
    ids, prompts, columns, names, cut = [], [], [], {}, 0
    for group in groups(found):
        checked = [(where, *_checked(where, row)) for where, row in group]
        for (_, prompt, other), encoded in zip(checked, encoder.encode(
                [(where, prompt) for where, prompt, _ in checked]), strict=True):
            if len(encoded) > limit:
                encoded, cut = encoded[len(encoded) - limit:], cut + 1
            ids.append(encoded)
            prompts.append(prompt)
            columns.append(other)
            names.update(dict.fromkeys(other))
    if not ids:
        where = "data.path" if source is None else "data source"
        raise ConfigError(f"{where}: {name} holds no prompt (no row)")
    if cut:
        unset = "; unset, it is data.seq_len // 2" if data.max_prompt_len is None else ""
        logging.getLogger("zjax").warning(
            "data.max_prompt_len: %d of %d prompts of %s were cut to their last %d tokens "
            "(their start dropped%s)", cut, len(ids), name, limit, unset)
    n = len(ids)
    return PromptSet(ids=tuple(ids), prompts=tuple(prompts), columns=tuple(columns),
                     column_names=tuple(names), n_train=n - int(n * data.eval_fraction),
                     vocab_size=encoder.vocab_size, source=name, cut=cut, prompt_limit=limit,
                     eos_id=encoder.eos_id)


def prompt_batches(prompts: PromptSet, data: DataConfig, *, split: str, seed: int,
                   n_prompts: int, process_index: int = 0, process_count: int = 1
                   ) -> grain.DatasetIterator | None:
    """A checkpointable iterator of this process's batches of prompt indices (int64
    ``[n_prompts / processes]`` arrays into ``prompts``), the split's prompts reshuffled
    every epoch from ``seed``; ``get_state()`` / ``set_state()`` resume at the exact next
    batch. The processes take alternate prompts of each global batch.

    An ``eval`` split shorter than a batch wraps around (a batch repeats some prompts); one
    with no prompt gives None (no evaluation) and logs a warning.

    Raises:
      ConfigError: ``n_prompts`` (from ``data.batch_size``) not divisible by the processes,
        or a train split with fewer prompts than one batch.
    """
    if n_prompts < 1 or n_prompts % process_count:
        raise ConfigError(f"data.batch_size: {data.batch_size} gives {n_prompts} prompts per "
                          f"batch, not a positive multiple of the {process_count} processes "
                          "(each generates from whole prompts)")
    indices = prompts.split(split)
    if split == "train" and len(indices) < n_prompts:
        raise ConfigError(f"data.batch_size: {data.batch_size}, but the train split of "
                          f"{prompts.source} holds {len(indices)} prompts, fewer than one "
                          f"batch of {n_prompts}; lower data.batch_size or add data")
    if not len(indices):
        warn_no_eval(data, prompts.source, "prompt")
        return None
    ds = grain.MapDataset.source(indices).shuffle(seed=seed).repeat()
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(n_prompts // process_count, drop_remainder=True)
    # indices in memory: no reading threads (grain's advice), no buffer to refill on resume
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def left_padded(ids: Sequence[np.ndarray], *, pad_id: int = 0, width: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, lengths)``: the prompts right-aligned in int32 ``[B, L]`` (``L``: ``width``,
    else the longest; ``pad_id`` before the shorter ones) and their int32 ``[B]`` lengths."""
    lengths = np.asarray([len(i) for i in ids], np.int32)
    if width is None:
        width = int(lengths.max()) if len(lengths) else 0
    tokens = np.full((len(lengths), width), pad_id, np.int32)
    for row, (one, n) in enumerate(zip(ids, lengths, strict=True)):
        if n:
            tokens[row, width - n:] = one
    return tokens, lengths


def gather_columns(prompts: PromptSet, indices: Iterable[int]
                   ) -> tuple[list[Any], dict[str, list[Any]]]:
    """``(prompt values, {column: values})`` of the prompts at ``indices``, in order, for the
    reward functions: every column of the set, None where a row has no value."""
    picked = [int(i) for i in indices]
    columns = {c: [prompts.columns[i].get(c) for i in picked] for c in prompts.column_names}
    return [prompts.prompts[i] for i in picked], columns
