"""Prompt data (``data.format: prompt``, TRL's GRPO datasets): text prompts encoded with the
special tokens, message prompts with the chat template's generation prompt, the other columns
carried unchanged from every source format, the left cut and its one warning, the bad rows
named, batches of prompt indices (shuffled by epoch, resumed, split between processes), the
train/eval split, left padding and the reward functions' columns. No step compiles."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
from sft_data import chat_dir, write_sources

from zjax import cli
from zjax.data import (
    DataConfig,
    document_batches,
    gather_columns,
    left_padded,
    load_chat_template,
    load_corpus,
    load_prompts,
    load_tokenizer,
    prompt_batches,
    tokenize_records,
)
from zjax.errors import ConfigError

_say = lambda role, content: {"role": role, "content": content}
CHAT = [_say("system", "Answer with a number."), _say("user", "What is 2 + 2?")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A chat tokenizer (ChatML) whose encoding adds a BOS (<|endoftext|>) to a text."""
    from tokenizers import Tokenizer, processors

    path = chat_dir(tmp_path_factory.mktemp("chat"), 60)[0]
    t = Tokenizer.from_file(str(path))
    bos = t.token_to_id("<|endoftext|>")
    t.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    t.save(str(path))
    return path


def _data(tok, **kw) -> DataConfig:
    return DataConfig(**{"tokenizer": None if tok is None else str(tok), "format": "prompt",
                         "seq_len": 64, "batch_size": 4, "eval_fraction": 0.0, **kw})


def _numbered(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def test_text_prompts_are_encoded_with_the_special_tokens(tok):
    t = load_tokenizer(str(tok))
    rows = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "And 3 + 3?"}]
    got = load_prompts(_data(tok), rows)
    assert len(got) == 2 and got.source == "list" and got.cut == 0
    for ids, row in zip(got.ids, rows, strict=True):
        want = t.encode(row["prompt"], add_special_tokens=True).ids
        assert ids.dtype == np.int32 and ids.tolist() == want
        assert want[0] == t.token_to_id("<|endoftext|>")  # the BOS
    assert got.prompts == ("What is 2 + 2?", "And 3 + 3?")
    assert got.vocab_size == t.get_vocab_size() and got.eos_id == t.token_to_id("<|im_end|>")
    # byte-level: the UTF-8 bytes, no BOS
    got = load_prompts(_data(None), [{"prompt": "2 + 2 = ?é"}])
    assert got.ids[0].tolist() == list("2 + 2 = ?é".encode()) and got.vocab_size == 256
    assert got.eos_id is None
    # a tokenizer with no eos_token is no error (the completions end as generated)
    config = tok.parent / "tokenizer_config.json"
    saved = config.read_text()
    try:
        config.write_text(json.dumps({**json.loads(saved), "eos_token": None}))
        assert load_prompts(_data(tok), rows).eos_id is None
        assert load_prompts(_data(tok, eos_token="<|endoftext|>"), rows).eos_id == \
            t.token_to_id("<|endoftext|>")
    finally:
        config.write_text(saved)


def test_message_prompts_end_with_the_generation_prompt(tok, tmp_path):
    t, template = load_tokenizer(str(tok)), load_chat_template(str(tok))
    rows = [{"prompt": CHAT, "answer": "4"}, {"prompt": "text, in the same source"}]
    got = load_prompts(_data(tok, seq_len=256), rows)
    assert got.cut == 0
    text = template.render(CHAT, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert got.ids[0].tolist() == t.encode(text, add_special_tokens=False).ids  # no BOS
    assert got.ids[1].tolist() == t.encode(rows[1]["prompt"], add_special_tokens=True).ids
    assert got.prompts[0] == CHAT  # as given: the reward functions see the messages
    for path in write_sources(tmp_path, rows[:1] * 3).values():  # messages as Arrow structs
        read = load_prompts(_data(tok, seq_len=256, path=str(path)))
        assert read.prompts == (CHAT,) * 3 and read.ids[2].tolist() == got.ids[0].tolist()
    # messages need a tokenizer with a chat template
    with pytest.raises(ConfigError, match=r"^list row 0: field 'prompt' is a list of "
                                          r"messages, which needs data.tokenizer"):
        load_prompts(_data(None), rows)
    config = tok.parent / "tokenizer_config.json"
    saved = config.read_text()
    try:
        config.write_text(json.dumps({**json.loads(saved), "chat_template": None}))
        with pytest.raises(ConfigError, match=r"^list row 0: field 'prompt': chat needs a "
                                              r"chat template"):
            load_prompts(_data(tok, seq_len=256), rows)
    finally:
        config.write_text(saved)


ROWS = [  # the other columns, of every kind, as the reward functions receive them
    {"prompt": "What is 2 + 2?", "answer": "4", "score": 1.5, "steps": [1, 2], "note": None},
    {"prompt": "What is 3 + 3?", "answer": "6", "score": -2.0, "steps": [], "note": "x"},
    {"prompt": "What is 4 + 4?", "answer": "8", "score": 0.0, "steps": [3], "note": None},
]


@pytest.mark.parametrize("kind", ["jsonl", "gz", "zst", "parquet", "arrow", "hf", "list"])
def test_every_column_is_carried_unchanged(tok, tmp_path, kind):
    if kind == "list":
        got = load_prompts(_data(tok), ROWS)
    else:
        path = write_sources(tmp_path, ROWS)[kind]
        got = load_prompts(_data(tok, path=str(path)))
        assert got.source == str(path)
    assert got.columns == tuple({k: v for k, v in r.items() if k != "prompt"} for r in ROWS)
    assert got.column_names == ("answer", "score", "steps", "note")
    assert got.prompts == tuple(r["prompt"] for r in ROWS)


def test_long_prompts_are_cut_from_the_left_with_one_warning(tok, caplog):
    t = load_tokenizer(str(tok))
    rows = [{"prompt": "What is 1 + 2 + 3 + 4 + 5?"}, {"prompt": "2?"},
            {"prompt": CHAT}, {"prompt": "What is 10 + 20 + 30?"}]
    with caplog.at_level(logging.WARNING, logger="zjax"):
        got = load_prompts(_data(tok, seq_len=16, max_prompt_len=4), rows)
    full = load_prompts(_data(tok, seq_len=256, max_prompt_len=200), rows)
    assert [len(i) for i in full.ids][1] <= 4 and full.cut == 0
    for short, whole in zip(got.ids, full.ids, strict=True):
        assert short.tolist() == whole.tolist()[-4:]  # its last 4 tokens
    assert got.ids[1].tolist() == t.encode("2?").ids
    assert got.cut == 3 and got.prompt_limit == 4
    said = [r.getMessage() for r in caplog.records]
    assert said == ["data.max_prompt_len: 3 of 4 prompts of list were cut to their last 4 "
                    "tokens (their start dropped)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zjax"):  # unset: seq_len // 2
        assert load_prompts(_data(tok, seq_len=8), rows).prompt_limit == 4
    assert len(caplog.records) == 1
    assert "(their start dropped; unset, it is data.seq_len // 2)" in caplog.records[0].getMessage()


BAD = {  # the row, and what the error says after "d.jsonl, row 2: "
    "no prompt": ({"question": "2?"}, r"no field 'prompt' \(fields: 'question'\)"),
    "null": ({"prompt": None}, r"field 'prompt' is null"),
    "empty text": ({"prompt": " "}, r"field 'prompt' is empty \(no text\)"),
    "no message": ({"prompt": []}, r"field 'prompt' must be a non-empty list of \{role, "
                                   r"content\} messages"),
    "a number": ({"prompt": 4}, r"field 'prompt' holds int, expected text or a list of "
                                r"\{role, content\} messages"),
    "a mapping": ({"prompt": {"role": "user"}}, r"field 'prompt' holds dict"),
    "unknown role": ({"prompt": [_say("robot", "hi")]},
                     r"field 'prompt', message 0: unknown role 'robot'"),
    "no content": ({"prompt": [{"role": "user"}]},
                   r"field 'prompt', message 0: expected \{role, content\}"),
    "reserved column": ({"prompt": "2?", "completions": []},
                        r"field 'completions' has the name of the reward functions' own "
                        r"argument"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rows_are_refused_naming_the_file_and_row(tok, tmp_path, case):
    row, pattern = BAD[case]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1?"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match="^" + re.escape(str(path)) + ", row 2: " + pattern):
        load_prompts(_data(tok, path=str(path)))


def test_sources_that_are_not_prompt_records_are_refused(tok, tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    cases = ((None, r"empty"), (str(tmp_path / "a.txt"), r"'.*a.txt' is a token stream"),
             ({"a.jsonl": 1.0, "b.jsonl": 2.0}, r"a mapping of 2 weighted"))
    for path, pattern in cases:
        with pytest.raises(ConfigError, match=r"^data.path: " + pattern):
            load_prompts(_data(tok, path=path))
    with pytest.raises(ConfigError, match=r"^data source: list holds no prompt"):
        load_prompts(_data(tok), [])


def _take(it, n: int) -> list[np.ndarray]:
    return [next(it) for _ in range(n)]


def test_batches_cover_each_epoch_once_reshuffled_and_resume_exactly(tok):
    data = _data(tok)
    prompts = load_prompts(data, _numbered(12))
    it = prompt_batches(prompts, data, split="train", seed=3, n_prompts=4)
    batches = _take(it, 6)  # two epochs
    assert all(b.shape == (4,) and np.issubdtype(b.dtype, np.integer) for b in batches)
    first, second = np.concatenate(batches[:3]), np.concatenate(batches[3:])
    assert sorted(first) == sorted(second) == list(range(12))
    assert first.tolist() != list(range(12)) and first.tolist() != second.tolist()
    again = prompt_batches(prompts, data, split="train", seed=3, n_prompts=4)
    assert [b.tolist() for b in _take(again, 6)] == [b.tolist() for b in batches]
    other = prompt_batches(prompts, data, split="train", seed=4, n_prompts=4)
    assert np.concatenate(_take(other, 3)).tolist() != first.tolist()
    # resume: the state after two batches gives the third, in a new iterator too
    it = prompt_batches(prompts, data, split="train", seed=3, n_prompts=4)
    _take(it, 2)
    state = it.get_state()
    fresh = prompt_batches(prompts, data, split="train", seed=3, n_prompts=4)
    fresh.set_state(state)
    assert next(fresh).tolist() == next(it).tolist() == batches[2].tolist()


def test_two_processes_take_disjoint_halves_of_each_batch(tok):
    data = _data(tok)
    prompts = load_prompts(data, _numbered(12))
    whole = _take(prompt_batches(prompts, data, split="train", seed=0, n_prompts=4), 3)
    halves = [_take(prompt_batches(prompts, data, split="train", seed=0, n_prompts=4,
                                   process_index=p, process_count=2), 3) for p in (0, 1)]
    for k, batch in enumerate(whole):
        a, b = halves[0][k], halves[1][k]
        assert len(a) == len(b) == 2 and set(a).isdisjoint(b)
        assert sorted([*a, *b]) == sorted(batch)
    with pytest.raises(ConfigError, match=r"^data.batch_size: 4 gives 3 prompts per batch, "
                                          r"not a positive multiple of the 2 processes"):
        prompt_batches(prompts, data, split="train", seed=0, n_prompts=3, process_count=2)


def test_the_eval_split_is_the_tail(tok, caplog):
    data = _data(tok, eval_fraction=0.25)
    prompts = load_prompts(data, _numbered(10))
    assert prompts.split("train").tolist() == list(range(8))
    assert prompts.split("eval").tolist() == [8, 9]
    train = np.concatenate(_take(prompt_batches(prompts, data, split="train", seed=0,
                                                n_prompts=4), 2))
    assert sorted(train) == list(range(8))
    # an eval split shorter than a batch wraps around
    ev = _take(prompt_batches(prompts, data, split="eval", seed=0, n_prompts=4), 2)
    assert sorted(np.concatenate(ev)) == [8, 8, 8, 8, 9, 9, 9, 9]
    with pytest.raises(ConfigError, match=r"^data.batch_size: 4, but the train split of list "
                                          r"holds 8 prompts, fewer than one batch of 16"):
        prompt_batches(prompts, data, split="train", seed=0, n_prompts=16)
    none = _data(tok)
    with caplog.at_level(logging.WARNING, logger="zjax"):
        assert prompt_batches(load_prompts(none, _numbered(10)), none, split="eval", seed=0,
                              n_prompts=4) is None
    assert "holds no prompt to evaluate on" in caplog.records[-1].getMessage()


def test_left_padded_right_aligns_the_prompts():
    tokens, lengths = left_padded([np.array([1, 2, 3], np.int32), np.array([4], np.int32),
                                   np.array([5, 6], np.int32)], pad_id=9)
    assert tokens.dtype == lengths.dtype == np.int32
    assert tokens.tolist() == [[1, 2, 3], [9, 9, 4], [9, 5, 6]]
    assert lengths.tolist() == [3, 1, 2]
    tokens, lengths = left_padded([np.array([7], np.int32)])
    assert tokens.tolist() == [[7]] and lengths.tolist() == [1]


def test_gather_columns_gives_every_column_none_where_a_row_has_none(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1?", "answer": "1"}, {"prompt": CHAT, "hint": [1, {"a": None}]},
            {"prompt": "3?", "answer": 3, "hint": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts(_data(tok, path=str(path)))
    values, columns = gather_columns(prompts, np.array([0, 2, 1]))
    assert values == ["1?", "3?", CHAT]
    assert columns == {"answer": ["1", 3, None], "hint": [None, None, [1, {"a": None}]]}
    assert gather_columns(prompts, [0]) == (["1?"], {"answer": ["1"], "hint": [None]})


def test_prompts_are_neither_trained_on_nor_documents(tok, tmp_path, capsys, cli_logging):
    with pytest.raises(ConfigError, match=r"^data.train_on_prompt: true, but data.format "
                                          r"prompt trains on nothing of a prompt's tokens"):
        _data(tok, train_on_prompt=True)
    with pytest.raises(ConfigError, match=r"^data.format: prompt holds prompts to generate "):
        load_corpus(_data(tok), _numbered(8))
    with pytest.raises(ConfigError, match=r"^data.format: prompt holds prompts to generate "):
        document_batches(None, _data(tok), split="train", seed=0)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _numbered(4)))
    with pytest.raises(ConfigError, match=r"^--format prompt: prompts are read from their "
                                          r"records at the start of the run"):
        tokenize_records([str(path)], tmp_path / "out", data=_data(tok))
    rc = cli.main(["tokenize", str(path), "-o", str(tmp_path / "out"), "--tokenizer",
                   str(tok), "--format", "prompt", "--workers", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "tokenize is for text, chat, prompt_completion and preference" in err
    assert not (tmp_path / "out").exists()
