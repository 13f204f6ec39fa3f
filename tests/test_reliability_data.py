"""Issue 50, items 1, 4, 10 and 11: text sources are read whole, a damaged or truncated
record file is an error naming it (never a shorter dataset), a lone surrogate in a record is
an error naming the row, and a small dataset trains, its short eval split evaluated as one
padded batch whose padding counts for nothing."""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from zjax import cli
from zjax.data import (
    DataConfig,
    document_batches,
    load_corpus,
    load_tokens,
    pack,
    window_batches,
)
from zjax.data import _pipeline as pipeline
from zjax.errors import ConfigError

FAST = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2",
        "train.steps=1", "logging.tensorboard=false", "logging.progress=false"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A tiny word-level tokenizer (ids 0..~40) with an EOS in its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"question {i} answer {i % 10} the end." for i in range(10)]
    tok.train_from_iterator(words, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<eos>"], show_progress=False))
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return d / "tokenizer.json"


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"question {i % 10} " * 3, "completion": f"answer {i % 10} the end ."}
            for i in range(n)]


def _pc(tokenizer, path, **kw) -> DataConfig:
    return DataConfig(path=str(path), tokenizer=str(tokenizer), format="prompt_completion",
                      **kw)


def _train(tmp_path, capsys, *overrides) -> tuple[int, str]:
    code = cli.main(["train", "configs/tiny.yaml", *FAST, "--run-dir", str(tmp_path / "run"),
                     *overrides])
    err = capsys.readouterr().err
    return code, err


def _one_line(code: int, err: str, *needles: str) -> str:
    assert code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [x for x in err.strip().splitlines() if x.startswith("zjax")]
    assert len(lines) == 1 and lines[0].startswith("zjax: error: "), err[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- item 1: text sources are read whole ---------------------------------------------------

def test_text_past_64_mib_is_read_whole(tmp_path):
    """A 65 MiB file (text at its start, where a binary file is told apart; sparse after it:
    no disk) and a second file: the second's bytes end the stream (the old 64 MiB cap
    dropped it)."""
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "a.txt", "wb") as f:
        f.write(b"text\n" * 2**15)
        f.truncate(65 * 2**20)
    (tmp_path / "d" / "b.txt").write_bytes(b"the very end")
    tokens = load_tokens(str(tmp_path / "d"), eval_fraction=0.0)
    assert len(tokens.train) == 65 * 2**20 + 1 + len(b"the very end")
    assert bytes(tokens.train[-13:]) == b"\nthe very end" and tokens.vocab_size == 256
    # one file is memory-mapped, not read (its max is not taken either: bytes are 256)
    one = load_tokens(str(tmp_path / "d" / "a.txt"), eval_fraction=0.5)
    assert isinstance(one.train, np.memmap) and len(one.eval) == 65 * 2**19
    # a sample is read only when asked for, and is exactly that long
    assert len(load_tokens(str(tmp_path / "d"), max_bytes=1000, eval_fraction=0).train) == 1000


def test_tokenized_text_is_encoded_in_pieces_and_whole(tmp_path, monkeypatch):
    """With a tokenizer: every file, every line, cut into pieces at line ends (no text lost
    or doubled at a cut), files joined by a newline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = ["".join(f"line {i} of file {k}\n" for i in range(300)) for k in range(3)]
    texts[1] += "no newline at the end" + "x" * 500  # a long run without a line end
    for k, t in enumerate(texts):
        (tmp_path / f"{k}.txt").write_text(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    monkeypatch.setattr(pipeline, "_PIECE", 100)  # many pieces, one long run cut mid-line
    monkeypatch.setattr(pipeline, "_GROUP", 3)
    got = load_tokens(str(tmp_path / "*.txt"), tokenizer=str(tmp_path / "tok.json"),
                      eval_fraction=0.0)
    assert tok.decode(got.train.tolist()) == "\n".join(texts)


def test_default_source_reads_the_whole_standard_library():
    tokens = load_tokens(eval_fraction=0.0)
    files = pipeline.stdlib_files()
    assert len(tokens.train) == sum(f.stat().st_size for f in files) + len(files) - 1


# --- item 4: damaged and truncated record files ---------------------------------------------

def _damaged(tmp_path: Path, kind: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = _rows(3000)
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    table = pa.Table.from_pylist(rows)
    if kind == "zst-truncated":
        z = zstandard.ZstdCompressor().compress(lines)
        (tmp_path / "d.jsonl.zst").write_bytes(z[:len(z) // 2])
        return tmp_path / "d.jsonl.zst"
    if kind == "zst-garbage":
        (tmp_path / "d.jsonl.zst").write_bytes(os.urandom(4096))
        return tmp_path / "d.jsonl.zst"
    if kind == "gz-truncated":
        g = gzip.compress(lines)
        (tmp_path / "d.jsonl.gz").write_bytes(g[:len(g) // 2])
        return tmp_path / "d.jsonl.gz"
    if kind in ("gz-flipped", "gz-bad-deflate"):
        g = bytearray(gzip.compress(lines))
        if kind == "gz-flipped":  # the CRC tells
            g[len(g) // 2:len(g) // 2 + 16] = bytes(16)
        else:  # zlib.error: an invalid deflate block right after the header
            g[10:26] = b"\xff" * 16
        (tmp_path / "d.jsonl.gz").write_bytes(bytes(g))
        return tmp_path / "d.jsonl.gz"
    if kind.startswith("parquet"):
        pq.write_table(table, tmp_path / "d.parquet", row_group_size=500)
        b = bytearray((tmp_path / "d.parquet").read_bytes())
        if kind == "parquet-truncated":
            b = b[:len(b) // 2]
        else:  # a damaged page in the middle
            b[len(b) // 2:len(b) // 2 + 64] = bytes(range(64))
        (tmp_path / "d.parquet").write_bytes(bytes(b))
        return tmp_path / "d.parquet"
    sink = pa.BufferOutputStream()
    with (pa.ipc.new_stream if kind.startswith("arrow-stream") else pa.ipc.new_file)(
            sink, table.schema) as w:
        for k, batch in enumerate(table.to_batches(max_chunksize=500)):
            w.write_batch(batch)
            if k == 2:  # arrow-stream-at-batch: cut exactly after a whole batch
                at = sink.tell()
    data = sink.getvalue().to_pybytes()
    if kind == "arrow-file-flipped":  # whole, but a string buffer overwritten: not UTF-8
        data = data[:len(data) // 2] + b"\xff" * 32 + data[len(data) // 2 + 32:]
    else:
        data = data[:at] if kind == "arrow-stream-at-batch" else data[:len(data) // 2]
    (tmp_path / "d.arrow").write_bytes(data)
    return tmp_path / "d.arrow"


KINDS = ["zst-truncated", "zst-garbage", "gz-truncated", "gz-flipped", "gz-bad-deflate",
         "parquet-truncated", "parquet-page", "arrow-stream", "arrow-stream-at-batch",
         "arrow-file", "arrow-file-flipped"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_record_file_is_an_error_naming_it(tmp_path, tokenizer, kind):
    path = _damaged(tmp_path, kind)
    with pytest.raises(ConfigError) as e:
        load_corpus(_pc(tokenizer, path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_zst_cut_at_a_line_end_is_not_a_shorter_dataset(tmp_path, tokenizer):
    """Cut where the decoded text ends exactly at a line end: every line read is valid JSON,
    so only the unfinished frame tells the file is short."""
    import zstandard

    rows = _rows(2000)
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    z = zstandard.ZstdCompressor(level=1).compress(lines)
    for cut in range(len(z) - 1, len(z) // 2, -1):  # the last cut that decodes to whole lines
        dec = zstandard.ZstdDecompressor().decompressobj().decompress(z[:cut])
        if dec and dec.endswith(b"\n") and len(dec) < len(lines):
            break
    (tmp_path / "d.jsonl.zst").write_bytes(z[:cut])
    with pytest.raises(ConfigError, match="ends inside a zstd frame"):
        load_corpus(_pc(tokenizer, tmp_path / "d.jsonl.zst"))
    # two whole frames, one after the other, are read whole
    c = zstandard.ZstdCompressor()
    (tmp_path / "two.jsonl.zst").write_bytes(c.compress(lines[:999]) + c.compress(lines[999:]))
    assert len(load_corpus(_pc(tokenizer, tmp_path / "two.jsonl.zst")).sources[0][0]) == 2000


def test_a_datasets_directory_with_a_damaged_listing_names_it(tmp_path, tokenizer):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"dd': dataset_dict.json is not a datasets"):
        load_corpus(_pc(tokenizer, tmp_path / "dd"))


def test_a_damaged_file_exits_2_with_one_line(tmp_path, tokenizer, capsys, cli_logging):
    for kind in ("zst-truncated", "arrow-stream-at-batch", "parquet-page"):
        path = _damaged(tmp_path, kind)
        code, err = _train(tmp_path, capsys, f"data.path={path}", f"data.tokenizer={tokenizer}",
                           "data.format=prompt_completion")
        _one_line(code, err, str(path), "damaged or truncated" if kind != "arrow-stream-at-batch"
                  else "end-of-stream marker")
        path.unlink()


# --- item 10: text that is not text ---------------------------------------------------------

@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "a\\ud800b", "completion": "c"}', "field 'prompt' holds a lone surrogate"),
    ('{"prompt": "a", "completion": "\\uDFFF"}', "field 'completion' holds a lone surrogate"),
    ('{"prompt": null, "completion": "c"}', "field 'prompt' is null"),
    ('[' * 100000 + ']' * 100000, "nested too deeply"),
])
def test_a_bad_jsonl_row_is_an_error_naming_the_row(tmp_path, tokenizer, line, needle):
    (tmp_path / "d.jsonl").write_text('{"prompt": "ok", "completion": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError) as e:
        load_corpus(_pc(tokenizer, tmp_path / "d.jsonl"))
    assert f"{tmp_path / 'd.jsonl'}, row 2" in str(e.value) and needle in str(e.value)


def test_a_lone_surrogate_in_a_chat_message_names_it(tmp_path):
    from zjax.data._sources import check_text, object_rows

    row = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "x\udc80"}]}
    with pytest.raises(ConfigError, match=r"row 3: field 'messages'\[1\]\['content'\] holds a "
                                          r"lone surrogate"):
        check_text(row, ["messages"], "row 3")
    with pytest.raises(ConfigError, match=r"list row 0: field 'text' holds a lone surrogate"):
        list(object_rows([{"text": "\ud800"}], ["text"]))  # a Python source too


def test_a_lone_surrogate_exits_2_with_one_line(tmp_path, tokenizer, capsys, cli_logging):
    for fmt, line in (("text", '{"text": "\\ud800"}'),
                      ("prompt_completion", '{"prompt": "p", "completion": "\\ud83d!"}')):
        (tmp_path / "s.jsonl").write_text(line + "\n")
        code, err = _train(tmp_path, capsys, f"data.path={tmp_path / 's.jsonl'}",
                           f"data.format={fmt}")
        _one_line(code, err, f"{tmp_path / 's.jsonl'}, row 1", "lone surrogate")


# --- item 11: small datasets ----------------------------------------------------------------

def test_a_short_eval_split_is_one_padded_masked_batch(tmp_path, tokenizer):
    """The issue's shape: 2,000 prompt/completion rows at seq_len 128, batch 16: the eval
    split holds fewer windows than a batch; it is evaluated as one batch, padded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_rows(2000)), tmp_path / "d.parquet")
    data = _pc(tokenizer, tmp_path / "d.parquet", seq_len=128, batch_size=16)
    corpus = load_corpus(data)
    train = document_batches(corpus, data, split="train", seed=0)
    assert next(train)["tokens"].shape == (16, 129)
    it = document_batches(corpus, data, split="eval", seed=0)
    batch = next(it)
    mask, seg = batch["loss_mask"], batch["segment_ids"]
    real = np.flatnonzero(mask.any(axis=1))
    assert 0 < len(real) < 16 and np.array_equal(real, np.arange(len(real)))
    assert not mask[len(real):].any() and not seg[len(real):].any()
    assert not batch["tokens"][len(real):].any()
    # the eval documents are all there, each once: the masked tokens are the completions'
    docs = corpus.split("eval", data.eval_fraction)[0][0]
    windows = pack(docs, seq_len=128, packing=True)
    assert len(docs) == 100 and len(windows) == len(real)
    assert int(mask.sum()) == sum(int(w["loss_mask"].sum()) for w in windows) == 100 * 6
    for _ in range(3):  # the same batch, again and again
        again = next(it)
        assert all(np.array_equal(again[k], batch[k]) for k in batch)
    # two processes each take their half of the one global batch
    halves = [next(document_batches(corpus, data, split="eval", seed=0, process_index=p,
                                    process_count=2)) for p in range(2)]
    assert np.array_equal(np.sort(np.concatenate([h["tokens"] for h in halves]), axis=0),
                          np.sort(batch["tokens"], axis=0))


def test_a_train_split_below_one_batch_is_refused(tmp_path, tokenizer, capsys, cli_logging):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(40)))
    data = _pc(tokenizer, tmp_path / "d.jsonl", seq_len=128, batch_size=16)
    with pytest.raises(ConfigError, match=r"^data.batch_size: 16, but the train split .*"
                                          r"\(data.seq_len 128 .*fewer than one batch"):
        document_batches(load_corpus(data), data, split="train", seed=0)
    tokens = np.arange(100, dtype=np.int32) % 7
    with pytest.raises(ConfigError, match=r"^data.batch_size: 16, .* lower data.batch_size or "
                                          r"data.seq_len"):
        window_batches(tokens, global_batch=16, seq_len=8, seed=0)
    code, err = _train(tmp_path, capsys, f"data.path={tmp_path / 'd.jsonl'}",
                       f"data.tokenizer={tokenizer}", "data.format=prompt_completion",
                       "model.vocab_size=64")
    _one_line(code, err, "data.batch_size: 16", "data.seq_len")


def test_no_eval_document_warns_once_and_gives_none(tmp_path, tokenizer, caplog):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(19)))
    data = _pc(tokenizer, tmp_path / "d.jsonl", seq_len=16, batch_size=2)  # 0.05 of 19: none
    with caplog.at_level(logging.WARNING, logger="zjax"):
        assert document_batches(load_corpus(data), data, split="eval", seed=0) is None
    warned = [r for r in caplog.records if "eval" in r.getMessage()]
    assert len(warned) == 1 and "training without evaluation" in warned[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="zjax"):
        assert window_batches(np.arange(1, dtype=np.int32), global_batch=2, seq_len=4,
                              seed=0, split="eval") is None


def test_a_short_stream_eval_split_is_padded_and_masked():
    tokens = np.arange(1, 24, dtype=np.int32)  # 23 tokens: 2 whole windows of 9, 1 partial
    batch = next(window_batches(tokens, global_batch=8, seq_len=8, seed=0, split="eval"))
    assert sorted(batch) == ["loss_mask", "tokens"] and batch["tokens"].shape == (8, 9)
    assert np.array_equal(batch["tokens"][0], tokens[:9])
    assert np.array_equal(batch["tokens"][2], np.pad(tokens[16:], (0, 2)))
    assert batch["loss_mask"][:2].all() and batch["loss_mask"][2].sum() == 7
    assert not batch["loss_mask"][3:].any() and not batch["tokens"][3:].any()


def test_padding_rows_add_nothing_to_the_loss(tmp_path, tokenizer):
    """lm_loss on the padded eval batch is lm_loss on its real rows alone (sum and count),
    for packed documents and for a stream."""
    from flax import nnx

    from zjax.models.gpt import GPT, GPTConfig, lm_loss

    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                          max_seq_len=32), rngs=nnx.Rngs(0))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(200)))
    data = _pc(tokenizer, tmp_path / "d.jsonl", seq_len=32, batch_size=16)
    docs = next(document_batches(load_corpus(data), data, split="eval", seed=0))
    stream = next(window_batches(np.arange(1, 60, dtype=np.int32) % 64, global_batch=8,
                                 seq_len=16, seed=0, split="eval"))
    for batch in (docs, stream):
        n = int(batch["loss_mask"].any(axis=1).sum())
        assert 0 < n < len(batch["tokens"])
        whole = [float(x) for x in lm_loss(model, batch)]
        alone = [float(x) for x in lm_loss(model, {k: v[:n] for k, v in batch.items()})]
        np.testing.assert_allclose(whole, alone, rtol=1e-6)
        assert np.isfinite(whole).all()


@pytest.mark.parametrize("name", ["table.csv", "rows.json", "rows.jsonl.bz2", "packed.gz.txt"])
def test_a_file_that_is_not_text_is_not_trained_on_as_bytes(tmp_path, name):
    """``data.path`` naming a tabular, JSON or compressed file is refused, naming it: its
    bytes would otherwise be trained on as text (the sibling of tokenize's check)."""
    f = tmp_path / name
    f.write_bytes(gzip.compress(b"a,b\n1,2\n" * 100) if name.endswith(".txt")
                  else b"a,b\n1,2\n" * 100)
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_tokens(str(f), eval_fraction=0.0)


def test_what_an_interrupted_tokenize_left_is_never_read(tmp_path):
    """A partial output (``.OUT.partial-PID-xxxx``, left by a kill -9) inside a data
    directory is neither text nor records to training."""
    d = tmp_path / "d"
    (d / ".out.partial-123-abcd").mkdir(parents=True)
    (d / ".out.partial-123-abcd" / "left.txt").write_text("leftover " * 50)
    (d / "a.txt").write_text("kept")
    assert bytes(load_tokens(str(d), eval_fraction=0.0).train) == b"kept"
    (d / "rows.jsonl").write_text('{"text": "kept"}\n')
    (d / ".out.partial-123-abcd" / "more.jsonl").write_text('{"text": "left"}\n')
    from zjax.data._sources import record_files

    assert record_files(str(d / "*.jsonl")) == [d / "rows.jsonl"]
    (d / "a.txt").unlink()
    assert record_files(str(d)) == [d / "rows.jsonl"]
