"""Preference rows to documents: each row of ``data.format: preference`` gives two, its chosen
sequence then its rejected one (``(ids int32, loss mask uint8)`` as the other formats'), the
prompt the same in both and the loss on the answer only. A ``zjax tokenize`` directory of them
holds pair ``k`` as documents ``2k`` (chosen) and ``2k + 1`` (rejected).

Layouts (Hugging Face TRL's preference datasets):

- standard: ``prompt``, ``chosen`` and ``rejected`` are text. A sequence is the prompt
  encoded with the tokenizer's special tokens (its BOS), the answer without them, then the
  EOS (as ``prompt_completion``); the loss is on the answer and its EOS.
- standard without a prompt (no ``prompt`` field, or null): the prompt is empty (the BOS alone,
  where the tokenizer adds one) and the whole answer is trained on. TRL would take the
  answers' common start as the prompt; its log-probabilities are the same in both sequences
  and cancel in the preference loss, so the texts are kept whole.
- conversational, explicit prompt: ``prompt``, ``chosen`` and ``rejected`` are lists of
  ``{role, content}`` messages. ``prompt + answer`` is rendered with the tokenizer's chat
  template (as ``chat``); the prompt is the text before the answer's first assistant turn
  (the generation header included), the answer the rest, each encoded without added special
  tokens (the template writes them), apart, as TRL encodes them, so both sequences share the
  prompt's ids. The loss is on the answer's assistant turns (their end-of-turn token
  included), never on an assistant turn of the prompt.
- conversational, implicit prompt (no ``prompt``): ``chosen`` and ``rejected`` are whole
  conversations; their longest common prefix of messages is the prompt, the rest of each its
  answer.

Cut to fit (TRL's ``truncation_mode="keep_end"``): a prompt longer than ``data.max_prompt_len``
tokens (``seq_len // 2`` unset) keeps its last ones; then an answer is cut at its end so that
prompt and answer fill at most ``seq_len + 1`` tokens, one row. The rows cut are counted
(:class:`PreferenceStats`, ``Encoder.stats``) and said in one warning per source.

Bad input:

- refused (a ConfigError naming the row, and the field): a row without ``chosen`` or
  ``rejected`` (the row readers), text mixed with message lists, an empty answer (a text, or
  the answer messages' contents, all whitespace; no answer message after an implicit
  prompt), an answer message whose role is not ``assistant``, conversations that share no
  first message when there is no ``prompt``, a conversation without ``data.tokenizer``.
- skipped: a row whose ``chosen`` equals its ``rejected`` (its gradient would be zero), as
  given or once cut to fit (the answers differ only past ``seq_len + 1`` tokens, or the
  prompt fills the row): it gives no document (pairs stay aligned), and is counted and said
  in one warning per source naming the first. A source whose rows are all skipped is refused,
  saying so (it would otherwise train on nothing, its loss ln 2 throughout).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from zjax.data._chat import check_messages, span_mask
from zjax.errors import ConfigError

__all__ = ["PairEncoder", "PreferenceStats", "encode_pairs"]

FIELDS = ("prompt", "chosen", "rejected")


class PairEncoder(Protocol):
    """What encoding pairs takes of the encoder (``zjax.data._documents.Encoder``, which
    imports this module: named by what it does, so this module imports none of it).

    Attributes:
      tokenizer: the ``tokenizers.Tokenizer`` (None: byte-level).
      prompt_limit: ``data.max_prompt_len`` (``seq_len // 2`` unset).
      room: the tokens of one row, ``seq_len + 1``.
    """

    tokenizer: Any
    prompt_limit: int
    room: int

    def encode_texts(self, texts: list[str], *, special: bool) -> list[np.ndarray]: ...

    def with_eos(self, ids: np.ndarray) -> np.ndarray: ...

    def chat_template(self, where: str) -> Any: ...


@dataclasses.dataclass
class PreferenceStats:
    """What encoding a source's preference rows cut and skipped.

    Attributes:
      rows: the rows read.
      prompt_cut: rows whose prompt was cut (from the left) to ``data.max_prompt_len``.
      answer_cut: rows with an answer cut (at its end) to fit ``seq_len + 1`` tokens.
      skipped: rows skipped, their chosen answer equal to the rejected one (as given, or
        once cut to fit).
      skipped_cut: of those, the rows whose answers became equal only once cut.
      first_skipped: where the first of those is.
    """

    rows: int = 0
    prompt_cut: int = 0
    answer_cut: int = 0
    skipped: int = 0
    skipped_cut: int = 0
    first_skipped: str | None = None

    def skip(self, where: str, *, cut: bool) -> None:
        """Count the row at ``where`` skipped (``cut``: equal only once cut to fit)."""
        self.skipped += 1
        self.skipped_cut += cut
        self.first_skipped = self.first_skipped or where

    def add(self, other: PreferenceStats) -> None:
        """Count ``other``'s rows (later rows than these) too."""
        if self.first_skipped is None:
            self.first_skipped = other.first_skipped
        self.rows += other.rows
        self.prompt_cut += other.prompt_cut
        self.answer_cut += other.answer_cut
        self.skipped += other.skipped
        self.skipped_cut += other.skipped_cut

    def report(self, *, prompt_limit: int, room: int, source: str | None = None) -> None:
        """One warning for the cuts, one for the skipped rows (none where there is none).

        Raises:
          ConfigError: every row was skipped (``source``: what to name, e.g. ``data.path:
            FILE``; else the first row skipped is named).
        """
        log = logging.getLogger("zjax")
        said = []
        if self.prompt_cut:
            said.append(f"data.max_prompt_len: {self.prompt_cut} of {self.rows} preference "
                        f"rows had their prompt cut to {prompt_limit} tokens (from the left)")
        if self.answer_cut:
            of = "" if said else f" of {self.rows} preference rows"
            said.append(f"data.seq_len: {self.answer_cut}{of} had an answer cut to fit "
                        f"{room} tokens")
        if said:
            log.warning("; ".join(said))
        if not self.skipped:
            return
        # a pair cut to equal rows would train at ln 2 with no gradient: said as equal pairs
        cut = (f" ({self.skipped_cut} of them only once cut to fit {room} tokens, "
               "data.seq_len + 1)") if self.skipped_cut else ""
        why = (f"their chosen answer is their rejected one{cut}, a pair the preference loss "
               "learns nothing from")
        if self.skipped == self.rows:
            raise ConfigError(f"{source or 'data.path'}: all {self.rows} preference pairs were "
                              f"skipped as identical (the first: {self.first_skipped}): {why}"
                              "; nothing is left to train on")
        log.warning("%d of %d preference rows were skipped (the first: %s): %s",
                    self.skipped, self.rows, self.first_skipped, why)


@dataclasses.dataclass(frozen=True)
class _Pair:
    where: str
    chat: bool
    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]


def encode_pairs(encoder: PairEncoder, group: Sequence[tuple[str, dict]],
                 stats: PreferenceStats):
    """The documents of a group of preference rows: each row's chosen then rejected sequence
    (none for a row skipped: equal answers, as given or once cut to fit), cut to fit;
    ``stats`` counts the cuts and skips, in the rows' order."""
    parsed = [(where, _parse(encoder, where, row)) for where, row in group]
    pairs = [p for _, p in parsed if p is not None]
    encoded: list = [None] * len(pairs)
    for chat, encode in ((False, _encode_text), (True, _encode_chat)):
        picked = [i for i, p in enumerate(pairs) if p.chat == chat]
        if picked:
            for i, sequences in zip(picked, encode(encoder, [pairs[i] for i in picked]),
                                    strict=True):
                encoded[i] = sequences
    fitted = iter(encoded)
    for where, pair in parsed:
        stats.rows += 1
        if pair is None:
            stats.skip(where, cut=False)
            continue
        (chosen, chosen_mask), (rejected, rejected_mask) = two = _fit(
            next(fitted), encoder.prompt_limit, encoder.room, stats)
        if np.array_equal(chosen, rejected) and np.array_equal(chosen_mask, rejected_mask):
            stats.skip(where, cut=True)  # the answers differed only in what was cut
            continue
        yield from two


def _kind(value) -> str:
    return "text" if isinstance(value, str) else "messages" if isinstance(value, list) else ""


def _parse(encoder: PairEncoder, where: str, row: dict) -> _Pair | None:
    """The row's layout and parts, checked; None where its answers are the same."""
    values = {f: row.get(f) for f in FIELDS if row.get(f) is not None}
    kinds = {f: _kind(v) for f, v in values.items()}
    for f, kind in kinds.items():
        if not kind:
            raise ConfigError(f"{where}: field {f!r} holds {type(values[f]).__name__}, "
                              "expected text or a list of {role, content} messages")
    if len(set(kinds.values())) > 1:
        have = ", ".join(f"{f!r} {k}" for f, k in kinds.items())
        raise ConfigError(f"{where}: fields {have}: a preference row is all text (standard) "
                          "or all lists of {role, content} messages (conversational)")
    chosen, rejected = values["chosen"], values["rejected"]
    if kinds["chosen"] == "text":
        for field, answer in (("chosen", chosen), ("rejected", rejected)):
            if not answer.strip():
                raise ConfigError(f"{where}: field {field!r} is empty: a preference pair "
                                  "compares two answers")
        return None if chosen == rejected else _Pair(where, False, values.get("prompt", ""),
                                                     chosen, rejected)
    chosen = check_messages(chosen, "chosen", where)
    rejected = check_messages(rejected, "rejected", where)
    if chosen == rejected:
        return None
    if "prompt" in values:
        prompt, start = check_messages(values["prompt"], "prompt", where), 0
    else:
        prompt, chosen, rejected = _common_prefix(where, chosen, rejected)
        start = len(prompt)
    for field, answer in (("chosen", chosen), ("rejected", rejected)):
        _check_answer(where, field, answer, start)
    return _Pair(where, True, prompt, chosen, rejected)


def _common_prefix(where: str, chosen: list, rejected: list) -> tuple[list, list, list]:
    """``(prompt, chosen answer, rejected answer)``: the conversations split after their
    longest common prefix of messages."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0:
        raise ConfigError(f"{where}: fields 'chosen' and 'rejected' differ from their first "
                          "message, so they share no prompt (without a 'prompt' field, the "
                          "messages the two conversations start with are the prompt); add a "
                          "'prompt' field")
    return chosen[:k], chosen[k:], rejected[k:]


def _check_answer(where: str, field: str, answer: list[dict], start: int) -> None:
    """Refuse an answer with no message, a message not the assistant's, or no text."""
    if not answer:
        raise ConfigError(f"{where}: field {field!r} holds no answer after the prompt (the "
                          f"{start} messages both conversations start with)")
    for i, m in enumerate(answer):
        if m["role"] != "assistant":
            raise ConfigError(f"{where}: field {field!r}, message {start + i}: the answer's "
                              f"role is {m['role']!r}, expected 'assistant' (the preference "
                              "loss is over the assistant's reply)")
    if not "".join(m["content"] for m in answer).strip():
        raise ConfigError(f"{where}: field {field!r}: the answer is empty (its messages hold "
                          "no text): a preference pair compares two answers")


def _encode_text(encoder: PairEncoder, pairs: list[_Pair]) -> list:
    """Each pair's two ``(prompt ids, answer ids, answer mask)``: standard layout."""
    prompts = encoder.encode_texts([p.prompt for p in pairs], special=True)
    answers = encoder.encode_texts([a for p in pairs for a in (p.chosen, p.rejected)],
                                   special=False)
    out = []
    for k, prompt in enumerate(prompts):
        two = [encoder.with_eos(ids) for ids in answers[2 * k:2 * k + 2]]
        out.append([(prompt, ids, np.ones(len(ids), np.uint8)) for ids in two])
    return out


def _encode_chat(encoder: PairEncoder, pairs: list[_Pair]) -> list:
    """Each pair's two ``(prompt ids, answer ids, answer mask)``: conversational layouts."""
    template = encoder.chat_template(pairs[0].where)
    parts = [_render(template, p, field, answer) for p in pairs
             for field, answer in (("chosen", p.chosen), ("rejected", p.rejected))]
    encs = encoder.tokenizer.encode_batch([t for prompt, answer, _ in parts
                                           for t in (prompt, answer)], add_special_tokens=False)
    sequences = []
    for j, (_, _, spans) in enumerate(parts):
        prompt, answer = encs[2 * j], encs[2 * j + 1]
        sequences.append((np.asarray(prompt.ids, np.int32), np.asarray(answer.ids, np.int32),
                          span_mask(answer, spans)))
    return [sequences[2 * k:2 * k + 2] for k in range(len(pairs))]


def _render(template, pair: _Pair, field: str, answer: list[dict]):
    """``(prompt text, answer text, the answer's assistant spans in it)``."""
    try:
        text, spans = template.render_with_spans([*pair.prompt, *answer])
    except ValueError as e:
        raise ConfigError(f"{pair.where}: field {field!r}: {e}") from None
    before = sum(m["role"] == "assistant" for m in pair.prompt)
    if len(spans) != before + len(answer):
        raise ConfigError(f"{pair.where}: field {field!r}: the chat template marks "
                          f"{len(spans)} assistant spans in a conversation of "
                          f"{before + len(answer)} assistant turns, so which are the answer's "
                          "is unknown")
    cut = spans[before][0]
    return text[:cut], text[cut:], [(a - cut, b - cut) for a, b in spans[before:]]


def _fit(sequences, limit: int, room: int, stats: PreferenceStats):
    """The pair's two documents: prompt (its last ``limit`` tokens) + answer, cut to ``room``
    tokens; the loss mask 0 on the prompt."""
    prompt_cut = answer_cut = False
    out = []
    for prompt, ids, mask in sequences:
        if len(prompt) > limit:
            prompt, prompt_cut = prompt[len(prompt) - limit:], True
        keep = room - len(prompt)
        answer_cut |= len(ids) > keep
        out.append((np.concatenate([prompt, ids[:keep]]).astype(np.int32),
                    np.concatenate([np.zeros(len(prompt), np.uint8), mask[:keep]])))
    stats.prompt_cut += prompt_cut
    stats.answer_cut += answer_cut
    return out
