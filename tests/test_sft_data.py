"""Fine-tuning data: record sources, chat templates and loss masks, packing, ``zjax
tokenize`` directories, bad records.

The chat masks are checked against transformers' own ``apply_chat_template`` with
``return_assistant_tokens_mask``; every source format must give the same documents.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from sft_data import chat_dir, sft_example, write_sources

from zjax import cli
from zjax.data import (
    ChatTemplate,
    DataConfig,
    Encoder,
    document_batches,
    load_corpus,
    pack,
    read_store,
    tokenize_records,
)
from zjax.errors import ConfigError

# a Llama-3-like template, written here: a BOS, headers, a default system turn
LLAMA_LIKE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nBe brief.<|im_end|>' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] | trim }}<|im_end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return chat_dir(tmp_path_factory.mktemp("chat"))


def _data(tokenizer, **kw) -> DataConfig:
    return DataConfig(tokenizer=str(tokenizer), format="chat", seq_len=64, batch_size=4, **kw)


def test_chat_masks_equal_transformers_apply_chat_template(chat, tmp_path):
    from transformers import PreTrainedTokenizerFast

    tokenizer, rows = chat
    config = json.loads((tokenizer.parent / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    config.update(chat_template=LLAMA_LIKE, bos_token="<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), bos_token="<|endoftext|>",
                                 eos_token="<|im_end|>")
    encoder = Encoder(_data(tmp_path / "tokenizer.json"))
    ours = list(encoder.documents((f"row {i}", r) for i, r in enumerate(rows[:60])))
    for row, (ids, mask) in zip(rows[:60], ours, strict=True):
        want = hf.apply_chat_template(row["messages"], chat_template=LLAMA_LIKE, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == want["input_ids"]
        assert mask.tolist() == want["assistant_masks"]
        assert 0 < mask.sum() < len(mask)


def test_spans_by_prefixes_equal_the_generation_blocks(chat):
    tagged = ChatTemplate(sft_example.CHATML, {})
    plain = ChatTemplate(sft_example.CHATML_PLAIN, {})
    for row in chat[1][:80]:
        text, spans = tagged.render_with_spans(row["messages"])
        assert plain.render_with_spans(row["messages"]) == (text, spans)
        assert [text[a:b].endswith("<|im_end|>") for a, b in spans] == [True] * len(spans)
    # a template whose earlier output depends on later turns is refused, not guessed at
    odd = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!"
                       "{% endif %}{% endfor %}", {})
    with pytest.raises(ValueError, match="generation"):
        odd.render_with_spans([{"role": "user", "content": "a"},
                               {"role": "assistant", "content": "b"},
                               {"role": "user", "content": "c"}])


def test_every_source_format_gives_the_same_documents(chat, tmp_path):
    tokenizer, rows = chat
    paths = write_sources(tmp_path, rows)
    want = load_corpus(_data(tokenizer), source=rows).sources[0][0]
    for name, path in paths.items():
        got = load_corpus(_data(tokenizer, path=str(path))).sources[0][0]
        for field in ("tokens", "loss_mask", "offsets"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"{name}: {field}")
    # a glob and a list name one source: the files' documents end to end
    both = load_corpus(_data(tokenizer, path=[str(paths["jsonl"]), str(paths["parquet"])]))
    assert len(both.sources) == 1 and len(both.sources[0][0]) == 2 * len(rows)


def test_a_tokenized_directory_trains_as_its_records(chat, tmp_path):
    tokenizer, rows = chat
    paths = write_sources(tmp_path / "src", rows[:120])
    data = _data(tokenizer, path=str(paths["jsonl"]))
    meta = tokenize_records([str(paths["jsonl"])], tmp_path / "tok", data=data)
    assert meta["documents"] == 120 and meta["format"] == "chat"
    store, fly = read_store(tmp_path / "tok"), load_corpus(data).sources[0][0]
    for field in ("tokens", "loss_mask", "offsets"):
        np.testing.assert_array_equal(getattr(store, field), getattr(fly, field))
    a = document_batches(load_corpus(data), data, split="train", seed=3)
    stored = DataConfig(**{**data.__dict__, "path": str(tmp_path / "tok")})
    b = document_batches(load_corpus(stored), stored, split="train", seed=3)
    for _ in range(5):
        x, y = next(a), next(b)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    with pytest.raises(ConfigError, match="train_on_prompt"):
        load_corpus(DataConfig(**{**stored.__dict__, "train_on_prompt": True}))


def _targets(window) -> np.ndarray:
    """The (token, next) pairs a window trains on, as split_batch weighs them."""
    seg, tok, mask = window["segment_ids"], window["tokens"], window["loss_mask"]
    w = (seg[1:] == seg[:-1]) & (seg[1:] != 0) & (mask[1:] == 1)
    return np.stack([tok[:-1][w], tok[1:][w]], 1)


@pytest.mark.parametrize("packing", [True, False])
def test_windows_train_on_every_masked_target_exactly_once(chat, packing):
    tokenizer, rows = chat
    docs = load_corpus(_data(tokenizer), source=rows).sources[0][0]
    windows = pack(docs, seq_len=20, packing=packing)  # most documents are cut
    got = np.concatenate([_targets(windows[i]) for i in range(len(windows))])
    want = []
    for i in range(len(docs)):
        a, b = docs.offsets[i], docs.offsets[i + 1]
        tok, mask = np.asarray(docs.tokens[a:b], np.int32), docs.loss_mask[a:b]
        want.append(np.stack([tok[:-1], tok[1:]], 1)[mask[1:] == 1])
    want = np.concatenate(want)
    if packing:  # best-fit decreasing moves pieces between windows: the same pairs, reordered
        got, want = (a[np.lexsort(a.T[::-1])] for a in (got, want))
    np.testing.assert_array_equal(got, want)
    sizes = [int(windows[i]["segment_ids"].max()) for i in range(len(windows))]
    assert max(sizes) > 1 if packing else max(sizes) == 1
    w = windows[0]
    pad = w["segment_ids"] == 0
    assert not w["loss_mask"][pad].any() and not w["tokens"][pad].any()


def test_prompt_completion_masks_the_prompt(chat):
    tokenizer = chat[0]
    rows = [{"prompt": "What is 2 + 2?", "completion": " 4."}]
    data = DataConfig(tokenizer=str(tokenizer), format="prompt_completion")
    (ids, mask), = Encoder(data).documents([("r", rows[0])])
    encoder = Encoder(data)
    n_prompt = len(encoder.tokenizer.encode(rows[0]["prompt"]).ids)
    assert mask.tolist() == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert ids[-1] == encoder.eos_id
    everything = DataConfig(tokenizer=str(tokenizer), format="prompt_completion",
                            train_on_prompt=True)
    (_, mask), = Encoder(everything).documents([("r", rows[0])])
    assert mask.all()


def test_sources_mix_by_weight(chat, tmp_path):
    tokenizer = chat[0]
    a = [{"text": "a" * 40} for _ in range(64)]
    b = [{"text": "b" * 40} for _ in range(64)]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(tokenizer=str(tokenizer), seq_len=32, batch_size=8, eval_fraction=0,
                      path={str(tmp_path / "a.jsonl"): 3, str(tmp_path / "b.jsonl"): 1})
    it = document_batches(load_corpus(data), data, split="train", seed=0)
    a_id = Encoder(data).tokenizer.encode("aaaa").ids[0]
    rows = np.concatenate([next(it)["tokens"] for _ in range(8)])
    share = np.mean([a_id in r for r in rows])
    assert share == pytest.approx(0.75, abs=0.07)


def _bad(tmp_path, tokenizer, name, text, **flags):
    (tmp_path / name).write_text(text)
    return ["tokenize", str(tmp_path / name), "-o", str(tmp_path / "out"), "--tokenizer",
            str(tokenizer), *[f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]]


CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}]})
BAD = {
    "not json": ("d.jsonl", CHAT + "\n{oops\n", {}, r"d\.jsonl, row 2: not JSON"),
    "missing field": ("d.jsonl", CHAT + "\n" + json.dumps({"msgs": []}) + "\n", {},
                      r"row 2: no field 'messages' \(fields: 'msgs'\)"),
    "unknown role": ("d.jsonl", json.dumps({"messages": [{"role": "assitant",
                                                          "content": "x"}]}) + "\n", {},
                     r"row 1: field 'messages', message 0: unknown role 'assitant'.*"
                     r"did you mean 'assistant'"),
    "no loss token": ("d.jsonl", json.dumps({"messages": [{"role": "user", "content": "x"}]})
                      + "\n", {}, r"row 1: field 'messages' holds no assistant turn"),
    "empty": ("d.jsonl", "\n", {}, r"the inputs hold no records"),
    "missing column": ("d.jsonl", json.dumps({"body": "x"}) + "\n", {"format": "text"},
                       r"row 1: no field 'text'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_one_line_naming_file_row_and_field(chat, tmp_path, capsys, case,
                                                           cli_logging):
    name, text, flags, pattern = BAD[case]
    argv = _bad(tmp_path, chat[0], name, text, **{"format": "chat", **flags})
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zjax: error: ") and len(err.splitlines()) == 1, err
    assert re.search(pattern, err), err
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.slow  # two CLI runs (the cases above are the fast loop's)
def test_a_chat_without_a_template_and_a_bad_row_stop_training_before_it_starts(chat,
                                                                                 tmp_path):
    from helpers import zjax_main

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(chat[0].read_bytes())
    (tmp_path / "d.jsonl").write_text(CHAT + "\n")
    common = ["train", "configs/sft-llama.yaml", f"data.path={tmp_path / 'd.jsonl'}",
              "train.init_from=null", "--run-dir", str(tmp_path / "run")]
    r = zjax_main(*common, f"data.tokenizer={bare / 'tokenizer.json'}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "data.format: chat needs a chat template" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "d.jsonl").write_text(CHAT + "\n" + "[1, 2]\n")
    r = zjax_main(*common, f"data.tokenizer={chat[0]}")
    assert r.returncode == 2 and "row 2: expected a JSON object" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sample_chat_renders_a_user_turn_and_stops_at_the_end_of_turn(chat, monkeypatch):
    from tokenizers import Tokenizer

    from zjax.export import sample as sampling

    tokenizer = Tokenizer.from_file(str(chat[0]))
    seen = {}
    reply = [*tokenizer.encode("2 + 2 = 4.").ids, tokenizer.token_to_id("<|im_end|>"), 5, 6]

    def fake_generate(model, prompt, **kw):  # the model's part is tested in test_sample
        seen["prompt"] = prompt
        return np.asarray([reply] * len(prompt))

    monkeypatch.setattr(sampling, "generate", fake_generate)
    sampler = sampling.Sampler(None, tokenizer, "test", chat[0])
    assert sampler.chat("What is 2 + 2?", n=2) == ["2 + 2 = 4."] * 2
    text = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert seen["prompt"][0].tolist() == tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.slow  # compiles and trains
def test_the_python_api_trains_on_a_list_of_records(chat):
    import zjax

    tokenizer, rows = chat
    config = zjax.load_config("configs/sft-llama.yaml", [
        "train.init_from=null", f"data.tokenizer={tokenizer}", "data.path=null",
        "data.seq_len=32", "data.batch_size=8", "train.steps=2", "train.log_every=1",
        "train.eval_every=0", "logging.tensorboard=false", "model.n_layers=1"])
    result = zjax.train(zjax.task.LlamaLanguageModel(source=rows), config)
    assert [r["step"] for r in result.history] == [1, 2]
    assert all(0 < r["loss_tokens"] < 8 * 32 for r in result.history)


def test_best_fit_decreasing_puts_each_piece_where_the_least_room_holds_it():
    from zjax.data._packing import _best_fit

    rng = np.random.default_rng(0)
    for capacity in (1, 7, 64, 129):
        lengths = rng.integers(1, capacity + 1, 300)
        got = _best_fit(lengths, capacity)
        rooms: list[int] = []  # the rule, one piece at a time, with a list scan
        want = np.empty(len(lengths), np.int64)
        for p in np.argsort(-lengths, kind="stable"):
            fits = [w for w, r in enumerate(rooms) if r >= lengths[p]]
            w = min(fits, key=lambda w: rooms[w]) if fits else len(rooms)
            if not fits:
                rooms.append(capacity)
            rooms[w] -= lengths[p]
            want[p] = w
        used = np.bincount(got, weights=lengths)
        assert used.max() <= capacity and got.max() + 1 == len(rooms)
        # ties between windows of equal room may go either way: compare the rooms left
        np.testing.assert_array_equal(np.sort(capacity - used), np.sort(rooms))


def test_text_streams_are_refused_where_documents_are_needed(tmp_path):
    from zjax.data import uses_documents

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("some text\n")
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    assert uses_documents(DataConfig(path=a)) is False  # a text file: one token stream
    for bad, needle in (({"path": [a, b]}, "a list or mapping"),
                        ({"path": {a: 1, b: 2}}, "a list or mapping"),
                        ({"path": a, "format": "chat"}, "data.format chat needs records")):
        with pytest.raises(ConfigError, match=needle):
            uses_documents(DataConfig(**bad))
