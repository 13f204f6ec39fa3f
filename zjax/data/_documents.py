"""Records to documents: each row's token ids and loss mask (1 where the token is trained on).

- ``text``: the text encoded with the tokenizer's special tokens (its BOS), then EOS; every
  token is trained on.
- ``prompt_completion``: the prompt (with the special tokens), the completion, then EOS; the
  loss is on the completion and its EOS.
- ``chat``: the conversation rendered with the tokenizer's chat template and encoded as
  transformers' ``apply_chat_template`` encodes it (no added special tokens: the template
  writes them); the loss is on the assistant turns' tokens, each turn's end-of-turn token
  included, as ``return_assistant_tokens_mask`` marks them.
- ``preference``: two documents per row, its chosen sequence then its rejected one, the loss
  on the answers only (:mod:`zjax.data._preference`: TRL's layouts, the cuts to fit
  ``data.seq_len``, the rows refused or skipped).
- ``prompt``: no documents (nothing is trained on a prompt's tokens); refused here, read by
  :mod:`zjax.data._prompts`.

``data.train_on_prompt`` trains on every token. Without ``data.tokenizer`` text is
byte-level (UTF-8 bytes, no BOS or EOS). The EOS is ``data.eos_token``, else the
``eos_token`` of the ``tokenizer_config.json`` beside the tokenizer; where neither names a
token of the vocabulary, ``text`` and ``prompt_completion`` are refused (naming the tokenizer,
what is missing and the tokens that look like an EOS) until ``data.eos_token`` says which,
or ``""`` for none: documents are never packed without an end marker unasked. Rows are
encoded in groups, by the tokenizer's own threads (all cores).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from zjax.data._chat import (
    check_messages,
    load_chat_template,
    span_mask,
    special_token,
    tokenizer_config,
)
from zjax.data._preference import PreferenceStats, encode_pairs
from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["Encoder", "eos_id", "groups", "span_mask"]

# rows per parallel encode call: large groups keep the tokenizer's threads busy (4096 rows of
# 4 KB: 0.86 of encode_batch's own rate on the whole input; 256: 0.73), bounded in characters
_GROUP, _GROUP_CHARS = 4096, 1 << 25


class Encoder:
    """Encodes the rows of one ``data`` section.

    Attributes:
      columns: the fields a row must have.
      optional: the fields a row may have (``preference``'s ``prompt``).
      vocab_size: one past the largest id it can produce.
      eos_id: the end-of-sequence id appended to text and completions (None: byte-level or
        none known).
      meta: what a ``zjax tokenize`` directory records of how it was made (for
        ``preference``, also the ``seq_len`` and ``max_prompt_len`` its rows were cut to).
      stats: ``preference``: what :meth:`documents` cut and skipped of the last source it
        encoded (:class:`~zjax.data._preference.PreferenceStats`); None for the other formats.
    """

    def __init__(self, data: DataConfig):
        if data.format == "prompt":  # (load_corpus refuses it first, in its own words)
            raise ConfigError("--format prompt: prompts are read from their records at the "
                              "start of the run (the reward functions need their other "
                              "columns); tokenize is for text, chat, prompt_completion and "
                              "preference")
        self.format, self.train_all = data.format, data.train_on_prompt
        self.columns = {"text": (data.text_field,), "chat": (data.messages_field,),
                        "prompt_completion": ("prompt", "completion"),
                        "preference": ("chosen", "rejected")}[data.format]
        self.optional = ("prompt",) if data.format == "preference" else ()
        self.meta = {"format": data.format, "train_on_prompt": data.train_on_prompt,
                     "tokenizer": data.tokenizer, "text_field": data.text_field,
                     "messages_field": data.messages_field}
        self.prompt_limit, self.room = data.prompt_limit, data.seq_len + 1
        if data.format == "preference":
            self.meta.update(seq_len=data.seq_len, max_prompt_len=data.prompt_limit)
        self.stats: PreferenceStats | None = None
        self.tokenizer, self.eos_id, self.template = None, None, None
        self.vocab_size = 256
        self.meta["tokenizer_id"] = None  # bytes
        if data.tokenizer is not None:
            from zjax.data._tokenizer import id_bound, load_tokenizer, tokenizer_identity

            self.tokenizer = load_tokenizer(data.tokenizer)
            self.vocab_size = id_bound(self.tokenizer)
            self.eos_id = eos_id(self.tokenizer, data)
            self.meta["tokenizer_id"] = tokenizer_identity(self.tokenizer, data.tokenizer,
                                                           eos_id=self.eos_id)
        if data.format == "chat":
            if self.tokenizer is None:
                raise ConfigError("data.format: chat needs data.tokenizer (a tokenizer.json "
                                  "with its chat template in the tokenizer_config.json beside)")
            self.template = load_chat_template(data.tokenizer)

    def documents(self, rows: Iterable[tuple[str, dict]], *, source: str | None = None
                  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(ids int32, loss mask uint8)`` of each row, in order (``preference``: two per
        row, none for a row skipped; its cuts and skips are said in a warning at the end, a
        source all skipped refused naming ``source``, e.g. ``data.path: FILE``)."""
        self.reset()
        for group in groups(rows):
            yield from self.encode_group(group)
        self.report(source=source)

    def reset(self) -> None:
        """Start counting a new source's cuts and skips (``preference``)."""
        self.stats = PreferenceStats() if self.format == "preference" else None

    def report(self, *, source: str | None = None) -> None:
        """Log what was cut and skipped of the rows since :meth:`reset` (one warning each).

        Raises:
          ConfigError: ``preference``: every row was skipped (its answers equal), naming
            ``source``.
        """
        if self.stats is not None:
            self.stats.report(prompt_limit=self.prompt_limit, room=self.room, source=source)

    def encode_group(self, group: list[tuple[str, dict]]):
        """The documents of one group of rows (the tokenizer encodes it in parallel)."""
        if self.format == "text":
            texts = [_text(row, self.columns[0], where) for where, row in group]
            for ids in self.encode_texts(texts, special=True):
                ids = self.with_eos(ids)
                yield ids, np.ones(len(ids), np.uint8)
        elif self.format == "prompt_completion":
            yield from self._prompt_completion(group)
        elif self.format == "preference":
            if self.stats is None:
                self.reset()
            yield from encode_pairs(self, group, self.stats)
        else:
            yield from self._chat(group)

    def encode_texts(self, texts: list[str], *, special: bool) -> list[np.ndarray]:
        """The int32 ids of each text (``special``: with the tokenizer's special tokens)."""
        if self.tokenizer is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=special)
        return [np.asarray(e.ids, np.int32) for e in encs]

    def with_eos(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` ending with the EOS (appended unless it is there, or there is none)."""
        if self.eos_id is None or (len(ids) and ids[-1] == self.eos_id):
            return ids
        return np.append(ids, np.int32(self.eos_id))

    def chat_template(self, where: str):
        """The chat template (loaded on first use), for a conversational row at ``where``."""
        if self.template is None:
            if self.tokenizer is None:
                raise ConfigError(f"{where}: a conversation (a list of messages) needs "
                                  "data.tokenizer (a tokenizer.json with its chat template in "
                                  "the tokenizer_config.json beside)")
            self.template = load_chat_template(self.meta["tokenizer"])
        return self.template

    def _prompt_completion(self, group):
        prompts = [_text(row, "prompt", where) for where, row in group]
        completions = [_text(row, "completion", where) for where, row in group]
        for p, c in zip(self.encode_texts(prompts, special=True),
                        self.encode_texts(completions, special=False), strict=True):
            c = self.with_eos(c)
            mask = np.concatenate([np.full(len(p), self.train_all, np.uint8),
                                   np.ones(len(c), np.uint8)])
            yield np.concatenate([p, c]), mask

    def _chat(self, group):
        field = self.columns[0]
        rendered = []
        for where, row in group:
            messages = check_messages(row[field], field, where)
            try:
                rendered.append(self.template.render_with_spans(messages))
            except ValueError as e:
                raise ConfigError(f"{where}: field {field!r}: {e}") from None
            if not self.train_all and not rendered[-1][1]:
                raise ConfigError(f"{where}: field {field!r} holds no assistant turn: nothing "
                                  "to train on (or set data.train_on_prompt: true)")
        encs = self.tokenizer.encode_batch([text for text, _ in rendered],
                                           add_special_tokens=False)
        for enc, (_, spans) in zip(encs, rendered, strict=True):
            ids = np.asarray(enc.ids, np.int32)
            mask = np.ones(len(ids), np.uint8) if self.train_all else span_mask(enc, spans)
            yield ids, mask


_EOS_LIKE = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>",
             "<end_of_turn>", "<|end|>", "[SEP]", "<|eos|>")


def eos_id(tokenizer, data: DataConfig) -> int | None:
    """The id ``data``'s documents end with: ``data.eos_token``, else the tokenizer config's
    ``eos_token`` (None: ``data.eos_token`` is ``""``, or none is named for a chat, whose
    template ends turns, or for prompts, whose completions are generated).

    Raises:
      ConfigError: the token named is not in the vocabulary, or none is named for ``text``
        or ``prompt_completion`` (naming the tokenizer and how to set one).
    """
    if data.eos_token == "":
        return None
    if data.eos_token is not None:
        found = tokenizer.token_to_id(data.eos_token)
        if found is None:
            raise ConfigError(f"data.eos_token: {data.eos_token!r} is not a token of "
                              f"{data.tokenizer}{_eos_hint(tokenizer)}")
        return found
    from pathlib import Path

    config = Path(data.tokenizer).parent / "tokenizer_config.json"
    eos = special_token(tokenizer_config(data.tokenizer), "eos_token")
    found = None if eos is None else tokenizer.token_to_id(eos)
    if found is not None or data.format in ("chat", "prompt"):
        return found
    why = (f"there is no {config}" if not config.is_file()
           else f"{config} names no eos_token" if eos is None
           else f"the eos_token {eos!r} of {config} is not in its vocabulary")
    raise ConfigError(
        f"data.tokenizer: {data.tokenizer}: {why}, so the {data.format} documents would be "
        "packed with no end-of-document token (the model would never learn where a document "
        "ends); set data.eos_token (zjax tokenize --eos-token) to the tokenizer's "
        f"end-of-document token{_eos_hint(tokenizer)}, or to '' to go without")


def _eos_hint(tokenizer) -> str:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    like = [t for t in _EOS_LIKE if t in vocab]
    return f" (it has {', '.join(map(repr, like))})" if like else ""


def groups(rows: Iterable[tuple[str, dict]]) -> Iterator[list[tuple[str, dict]]]:
    """``rows`` in groups of ``_GROUP`` rows or ``_GROUP_CHARS`` characters of text."""
    group: list[tuple[str, dict]] = []
    chars = 0
    for item in rows:
        group.append(item)
        chars += sum(len(v) for v in item[1].values() if isinstance(v, str))
        if len(group) == _GROUP or chars >= _GROUP_CHARS:
            yield group
            group, chars = [], 0
    if group:
        yield group


def _text(row: dict, field: str, where: str) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {field!r} holds {type(value).__name__}, expected "
                          "text (a string)")
    return value
