"""Preference data (``data.format: preference``): TRL's layouts encoded as two documents per row
(chosen, then rejected; the loss on the answer only), the cuts to fit a row, the rows refused
and skipped, batches of interleaved pairs (the split by pairs, resuming, ``ref_logps``, the
process slice) and ``zjax tokenize --format preference`` directories. No step compiles."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import numpy as np
import pytest
from sft_data import chat_dir, sft_example, write_sources

from zjax import cli
from zjax.data import (
    DataConfig,
    Encoder,
    abstract_preference_batch,
    load_corpus,
    preference_batches,
    preference_rows,
    tokenize_records,
)
from zjax.errors import ConfigError

_say = lambda role, content: {"role": role, "content": content}
USER = _say("user", "What is 2 + 2?")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A chat tokenizer whose template marks the assistant's turns ({% generation %})."""
    return chat_dir(tmp_path_factory.mktemp("chat"), 60)[0]


@pytest.fixture(scope="module")
def plain_tok(tok, tmp_path_factory):
    """The same tokenizer, its template without the marks (spans found by prefixes)."""
    out = tmp_path_factory.mktemp("plain")
    (out / "tokenizer.json").write_bytes(tok.read_bytes())
    config = json.loads((tok.parent / "tokenizer_config.json").read_text())
    config["chat_template"] = sft_example.CHATML_PLAIN
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out / "tokenizer.json"


def _data(tok, **kw) -> DataConfig:
    return DataConfig(**{"tokenizer": str(tok), "format": "preference", "seq_len": 64,
                         "batch_size": 4, **kw})


def _docs(encoder: Encoder, *rows: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    return list(encoder.documents((f"d.jsonl, row {i + 1}", r) for i, r in enumerate(rows)))


def _ids(encoder: Encoder, text: str, *, special: bool = False) -> list[int]:
    return encoder.tokenizer.encode(text, add_special_tokens=special).ids


def test_standard_rows_train_on_the_answer_and_its_eos(tok):
    encoder = Encoder(_data(tok))
    (c, cm), (r, rm) = _docs(encoder, {"prompt": "What is 2 + 2?", "chosen": " 4.",
                                       "rejected": " 5."})
    prompt = _ids(encoder, "What is 2 + 2?", special=True)
    eos = encoder.eos_id
    assert c.tolist() == [*prompt, *_ids(encoder, " 4."), eos]
    assert r.tolist() == [*prompt, *_ids(encoder, " 5."), eos]
    for ids, mask in ((c, cm), (r, rm)):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        assert mask.tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    # without a prompt, the whole answer (as a document of its own) is trained on
    (c, cm), (r, rm) = _docs(encoder, {"chosen": "4.", "rejected": "5."})
    assert c.tolist() == [*_ids(encoder, "", special=True), *_ids(encoder, "4."), eos]
    assert cm.all() and rm.all()


@pytest.mark.parametrize("template", ["tok", "plain_tok"])
def test_conversations_train_on_the_answer_turn_only(template, request):
    tok = request.getfixturevalue(template)
    encoder = Encoder(_data(tok, seq_len=256))
    prompt = [_say("system", "Be brief."), USER, _say("assistant", "Four?"),
              _say("user", "Sure?")]
    chosen, rejected = [_say("assistant", "4.")], [_say("assistant", "5.")]
    explicit = _docs(encoder, {"prompt": prompt, "chosen": chosen, "rejected": rejected})
    implicit = _docs(encoder, {"chosen": prompt + chosen, "rejected": prompt + rejected})
    n_prompt = len(_ids(encoder, encoder.chat_template("r").render(prompt,
                                                                   add_generation_prompt=True)))
    for answer, (ids, mask), (ids2, mask2) in zip((chosen, rejected), explicit, implicit,
                                                  strict=True):
        # the chat format's document of the conversation: every assistant turn masked in
        (want_ids, want_mask), = Encoder(_data(tok, format="chat")).documents(
            [("r", {"messages": prompt + answer})])
        assert ids.tolist() == want_ids.tolist() == ids2.tolist()
        # the chat format also trains on the prompt's assistant turn; preference does not
        assert want_mask[:n_prompt].any() and not mask[:n_prompt].any()
        assert mask[n_prompt:].tolist() == want_mask[n_prompt:].tolist() == mask2[
            n_prompt:].tolist()
        assert encoder.tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False) \
            == answer[0]["content"] + "<|im_end|>"
    assert explicit[0][0][:n_prompt].tolist() == explicit[1][0][:n_prompt].tolist()
    # the prompt is all that comes before the answer's turn: cut, its last 5 tokens stay
    (ids, mask), _ = _docs(Encoder(_data(tok, seq_len=256, max_prompt_len=5)),
                           {"prompt": prompt, "chosen": chosen, "rejected": rejected})
    assert ids.tolist() == explicit[0][0][n_prompt - 5:].tolist()
    assert mask.tolist() == explicit[0][1][n_prompt - 5:].tolist()


def test_prompts_are_cut_from_the_left_and_answers_at_the_end(tok, caplog):
    data = _data(tok, seq_len=16, max_prompt_len=6)
    encoder = Encoder(data)
    long_prompt = "What is 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8?"
    long_answer = " 1 + 2 = 3, 3 + 3 = 6, 6 + 4 = 10, 10 + 5 = 15."
    rows = [{"prompt": long_prompt, "chosen": long_answer, "rejected": " 36."},
            {"prompt": "2 + 2?", "chosen": " 4.", "rejected": " 5."},
            {"prompt": "2 + 3?", "chosen": long_answer, "rejected": " 5."}]
    with caplog.at_level(logging.WARNING, logger="zjax"):
        docs = _docs(encoder, *rows)
    full = _ids(encoder, long_prompt, special=True)
    assert len(full) > 6
    (c, cm), (r, rm) = docs[:2]
    assert c[:6].tolist() == r[:6].tolist() == full[-6:]  # its last 6 tokens
    assert len(c) == 17 and c[6:].tolist() == _ids(encoder, long_answer)[:11]  # no EOS left
    assert cm.tolist() == [0] * 6 + [1] * 11
    assert r.tolist() == [*full[-6:], *_ids(encoder, " 36."), encoder.eos_id]
    assert rm.tolist() == [0] * 6 + [1] * (len(r) - 6)
    assert len(docs[4][0]) == 17 and len(docs[5][0]) < 17  # row 3: its chosen answer cut
    stats = encoder.stats
    assert (stats.rows, stats.prompt_cut, stats.answer_cut, stats.skipped) == (3, 1, 2, 0)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["data.max_prompt_len: 1 of 3 preference rows had their prompt cut to 6 "
                    "tokens (from the left); data.seq_len: 2 had an answer cut to fit 17 "
                    "tokens"]


def test_equal_answers_are_skipped_counted_and_warned_of_once(tok, caplog):
    encoder = Encoder(_data(tok))
    same = {"prompt": "2 + 2?", "chosen": " 4.", "rejected": " 4."}
    same_chat = {"chosen": [USER, _say("assistant", "4.")],
                 "rejected": [USER, _say("assistant", "4.")]}
    good = {"prompt": "2 + 2?", "chosen": " 4.", "rejected": " 5."}
    with caplog.at_level(logging.WARNING, logger="zjax"):
        docs = _docs(encoder, good, same, good, same_chat)
    assert len(docs) == 4  # two pairs, each chosen then rejected
    assert [d[0][-2] for d in docs] == [_ids(encoder, " 4.")[-1], _ids(encoder, " 5.")[-1]] * 2
    assert (encoder.stats.skipped, encoder.stats.first_skipped) == (2, "d.jsonl, row 2")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "2 of 4 preference rows were skipped (the first: d.jsonl, row " \
        "2)" in said[0]


A, U = _say("assistant", "4."), USER
BAD = {  # the row, and what the one-line error says after "d.jsonl, row 2: "
    "no rejected": ({"prompt": "2 + 2?", "chosen": " 4."}, r"no field 'rejected'"),
    "null chosen": ({"chosen": None, "rejected": " 4."}, r"field 'chosen' is null"),
    "empty text": ({"prompt": "2?", "chosen": " 4.", "rejected": "  "},
                   r"field 'rejected' is empty"),
    "empty message": ({"prompt": [U], "chosen": [A], "rejected": [_say("assistant", " ")]},
                      r"field 'rejected': the answer is empty"),
    "user answer": ({"prompt": [U], "chosen": [_say("user", "4.")], "rejected": [A]},
                    r"field 'chosen', message 0: the answer's role is 'user', expected "
                    r"'assistant' \(the preference loss is over the assistant's reply\)"),
    "implicit user answer": ({"chosen": [U, A, _say("user", "ok")],
                              "rejected": [U, A, _say("user", "no")]},
                             r"field 'chosen', message 2: the answer's role is 'user'"),
    "no answer after the prefix": ({"chosen": [U, A], "rejected": [U, A, A]},
                                   r"field 'chosen' holds no answer after the prompt \(the "
                                   r"2 messages"),
    "no common prefix": ({"chosen": [A], "rejected": [_say("assistant", "5.")]},
                         r"fields 'chosen' and 'rejected' differ from their first message, so "
                         r"they share no prompt"),
    "mixed": ({"prompt": "2 + 2?", "chosen": [A], "rejected": [A]},
              r"fields 'prompt' text, 'chosen' messages, 'rejected' messages: a preference "
              r"row is all text"),
    "a number": ({"chosen": 4, "rejected": "5"}, r"field 'chosen' holds int, expected text"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_rows_are_refused_naming_the_row_and_field(tok, tmp_path, case):
    row, pattern = BAD[case]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1?", "chosen": " 1.", "rejected": " 2."}) + "\n"
                    + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ", row 2: " + pattern):
        load_corpus(_data(tok, path=str(path)))


def test_a_bad_row_stops_zjax_tokenize_with_exit_2(tok, tmp_path, capsys, cli_logging):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "2?", "chosen": " 4."}) + "\n")
    rc = cli.main(["tokenize", str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "out"),
                   "--tokenizer", str(tok), "--format", "preference", "--workers", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "row 1: no field 'rejected'" in err
    assert not (tmp_path / "out").exists()


def test_the_config_refuses_what_preference_cannot_do(tok):
    with pytest.raises(ConfigError, match=r"data.train_on_prompt: true, but data.format "
                                          r"preference trains on the answers only"):
        _data(tok, train_on_prompt=True)
    with pytest.raises(ConfigError, match=r"data.max_prompt_len: 64, but data.seq_len is 64"):
        _data(tok, max_prompt_len=64)
    assert _data(tok).prompt_limit == 32 and _data(tok, max_prompt_len=9).prompt_limit == 9
    with pytest.raises(ConfigError, match=r"row 1: a conversation .* needs data.tokenizer"):
        _docs(Encoder(_data(tok, tokenizer=None)), {"chosen": [U, A],
                                                     "rejected": [U, _say("assistant", "5")]})


def _pairs(n: int) -> list[dict]:
    """``n`` pairs, each with its own prompt; the rejected answer is one off."""
    return [{"prompt": f"What is {i} + {i % 7}?", "chosen": f" {i + i % 7}.",
             "rejected": f" {i + i % 7 + 1}."} for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _pairs(40)))
    data = _data(tok, path=str(path), seq_len=24, batch_size=8, eval_fraction=0.25)
    return data, load_corpus(data)


def test_batches_interleave_each_pair_with_its_reference_values(corpus):
    data, corp = corpus
    train = preference_rows(corp, data)
    assert train.counts == (60,)  # 30 of the 40 pairs
    refs = (np.arange(60, dtype=np.float32),)  # the document's own index
    it = preference_batches(corp, data, split="train", seed=0, ref_logps=refs)
    seen = set()
    for _ in range(8):  # two epochs
        batch = next(it)
        assert set(batch) == {"tokens", "segment_ids", "positions", "loss_mask", "ref_logps"}
        assert batch["tokens"].shape == (8, 25) and batch["tokens"].dtype == np.int32
        assert batch["ref_logps"].shape == (8,) and batch["ref_logps"].dtype == np.float32
        for row, ref in enumerate(batch["ref_logps"].astype(int)):
            assert ref % 2 == row % 2  # chosen rows even, rejected odd
            want = train.sources[0][ref]
            for k in want:
                np.testing.assert_array_equal(batch[k][row], want[k])
        chosen, rejected = batch["ref_logps"][0::2], batch["ref_logps"][1::2]
        np.testing.assert_array_equal(rejected, chosen + 1)  # the same pair
        seen.update(chosen.astype(int).tolist())
    assert seen == set(range(0, 60, 2))  # every train pair within two epochs
    row = train.sources[0][4]
    n = int(row["segment_ids"].sum())
    assert row["positions"][:n].tolist() == list(range(n)) and not row["tokens"][n:].any()
    assert train.sources[0].batch(56, 8)["tokens"][4:].sum() == 0  # padded past the end


def test_the_eval_split_is_the_last_pairs_padded_to_one_batch(corpus, caplog):
    data, corp = corpus
    held = preference_rows(corp, data, split="eval")
    assert held.counts == (20,)  # pairs 30..39: documents 60..79
    whole = corp.sources[0][0]
    a, b = int(whole.offsets[60]), int(whole.offsets[61])
    np.testing.assert_array_equal(held.sources[0][0]["tokens"][:b - a], whole.tokens[a:b])
    # 40 pairs * 0.2375 = 9.5: 9 pairs held out, never a pair cut in two (not 19 documents)
    odd = dataclasses.replace(data, eval_fraction=0.2375)
    assert preference_rows(corp, odd, split="eval").counts == (18,)
    assert preference_rows(corp, odd).counts == (62,)
    big = dataclasses.replace(data, batch_size=24)  # 12 pairs, 10 held out
    it = preference_batches(corp, big, split="eval", seed=0)
    a, b = next(it), next(it)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert a["segment_ids"][:20].any(axis=1).all() and not a["loss_mask"][20:].any()
    np.testing.assert_array_equal(a["tokens"][0], held.sources[0][0]["tokens"])
    with pytest.raises(ConfigError, match=r"data.batch_size: 64, but the train split of .* "
                                          r"holds 30 preference pairs"):
        preference_batches(corp, dataclasses.replace(data, batch_size=64), split="train",
                           seed=0)
    none = dataclasses.replace(data, eval_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="zjax"):
        assert preference_batches(corp, none, split="eval", seed=0) is None
    assert len([r for r in caplog.records if "no preference pair" in r.getMessage()]) == 1


def test_batches_resume_exactly_and_split_by_process(corpus):
    data, corp = corpus
    refs = (np.arange(60, dtype=np.float32),)
    it = preference_batches(corp, data, split="train", seed=1, ref_logps=refs)
    for _ in range(5):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]
    again = preference_batches(corp, data, split="train", seed=1, ref_logps=refs)
    again.set_state(state)
    for w in want:
        got = next(again)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])
    one = preference_batches(corp, data, split="train", seed=2, ref_logps=refs)
    halves = [preference_batches(corp, data, split="train", seed=2, ref_logps=refs,
                                 process_index=p, process_count=2) for p in range(2)]
    for _ in range(4):
        whole = next(one)["ref_logps"].tolist()
        parts = [next(h)["ref_logps"].tolist() for h in halves]
        assert [len(p) for p in parts] == [4, 4] and not set(parts[0]) & set(parts[1])
        assert sorted(parts[0] + parts[1]) == sorted(whole)
        for p in parts:
            assert p[1::2] == [x + 1 for x in p[0::2]]  # whole pairs on each process


def test_batch_sizes_count_rows_two_per_pair(corpus):
    data, corp = corpus
    with pytest.raises(ConfigError, match=r"data.batch_size: 7, but data.format preference "
                                          r"puts a pair's chosen and rejected sequences side "
                                          r"by side: use an even number of rows"):
        preference_batches(corp, dataclasses.replace(data, batch_size=7), split="train", seed=0)
    with pytest.raises(ConfigError, match=r"data.batch_size: 6 rows are 3 preference pairs, "
                                          r"not divisible by the 2 processes"):
        preference_batches(corp, dataclasses.replace(data, batch_size=6), split="train",
                           seed=0, process_count=2)
    shapes = abstract_preference_batch(data, ref_logps=True)
    assert {k: (v.shape, v.dtype) for k, v in shapes.items()} == {
        **{k: ((8, 25), np.int32) for k in ("tokens", "segment_ids", "positions",
                                            "loss_mask")},
        "ref_logps": ((8,), np.float32)}
    assert "ref_logps" not in abstract_preference_batch(data, ref_logps=False)


def test_every_source_format_reads_the_optional_prompt(tok, tmp_path):
    rows = _pairs(12)
    conversations = [{"chosen": [_say("user", r["prompt"]), _say("assistant", r["chosen"])],
                      "rejected": [_say("user", r["prompt"]), _say("assistant", r["rejected"])]}
                     for r in rows]
    for name, records in (("standard", rows), ("implicit", conversations),
                          ("no prompt", [{"chosen": r["chosen"], "rejected": r["rejected"]}
                                         for r in rows])):
        want = load_corpus(_data(tok), source=records).sources[0][0]
        for fmt, path in write_sources(tmp_path / name, records).items():
            got = load_corpus(_data(tok, path=str(path))).sources[0][0]
            for field in ("tokens", "loss_mask", "offsets"):
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                              err_msg=f"{name} {fmt}: {field}")
    # the prompt made a difference (it was read, not dropped)
    with_prompt = load_corpus(_data(tok), source=rows).sources[0][0]
    assert len(with_prompt.tokens) > len(want.tokens)


def _tokenize(tok, src, out, *extra) -> int:
    return cli.main(["tokenize", str(src), "-o", str(out), "--tokenizer", str(tok),
                     "--format", "preference", "--workers", "1", *extra])


def test_a_tokenized_directory_trains_as_its_records(tok, tmp_path, capsys, cli_logging):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _pairs(24)))
    data = _data(tok, path=str(src), seq_len=12, max_prompt_len=5, batch_size=4)
    assert _tokenize(tok, src, tmp_path / "tok", "--seq-len", "12", "--max-prompt-len",
                     "5") == 0
    stored = dataclasses.replace(data, path=str(tmp_path / "tok"))
    fly, disk = load_corpus(data).sources[0][0], load_corpus(stored).sources[0][0]
    assert disk.meta["format"] == "preference" and len(disk) == 48
    for field in ("tokens", "loss_mask", "offsets"):
        np.testing.assert_array_equal(getattr(disk, field), getattr(fly, field))
    a = preference_batches(load_corpus(data), data, split="train", seed=3)
    b = preference_batches(load_corpus(stored), stored, split="train", seed=3)
    for _ in range(4):
        x, y = next(a), next(b)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    with pytest.raises(ConfigError, match=r"data.seq_len: 16, but .*tok was tokenized with "
                                          r"seq_len 12"):
        load_corpus(dataclasses.replace(stored, seq_len=16))
    with pytest.raises(ConfigError, match=r"data.max_prompt_len: 6, but .*tok was tokenized "
                                          r"with max_prompt_len 5"):
        load_corpus(dataclasses.replace(stored, max_prompt_len=6))
    assert _tokenize(tok, src, tmp_path / "tok128") == 0  # the default seq_len
    with pytest.raises(ConfigError, match=r"data.seq_len: 12, but .*tok128 was tokenized with "
                                          r"seq_len 128"):
        load_corpus(dataclasses.replace(stored, path=str(tmp_path / "tok128")))


def test_workers_encode_the_same_documents_and_count_the_cuts(tok, tmp_path, caplog):
    rows = [*_pairs(6), {"prompt": "1?", "chosen": " 1.", "rejected": " 1."},
            {"prompt": "What is 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8?", "chosen": " 36.",
             "rejected": " 35."}]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _data(tok, seq_len=16, max_prompt_len=4)
    said = []
    for workers in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zjax"):
            tokenize_records([str(src)], tmp_path / f"w{workers}", data=data, workers=workers)
        said.append(sorted(r.getMessage() for r in caplog.records))
    one, two = (load_corpus(dataclasses.replace(data, path=str(tmp_path / f"w{w}")))
                .sources[0][0] for w in (1, 2))
    assert len(one) == 14
    for field in ("tokens", "loss_mask", "offsets"):
        np.testing.assert_array_equal(getattr(one, field), getattr(two, field))
    assert said[0] == said[1] and len(said[0]) == 2
    assert "1 of 8 preference rows were skipped (the first: " in said[0][0]
    assert "of 8 preference rows had their prompt cut to 4 tokens" in said[0][1]
