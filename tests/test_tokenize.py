"""Hugging Face tokenizers: `zjax tokenize` to a .npy, `data.tokenizer` on text, training on
the tokens. The tokenizer is a BPE trained here on the standard library (nothing downloaded)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ROOT, zjax_main

import zjax
from zjax.config import load_config
from zjax.data import load_tokens, stdlib_files


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(tokenizer.json, the files it was trained on): a 512-token byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = stdlib_files()[:40]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(f) for f in files], trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path, files


def test_tokenize_writes_the_ids_of_every_file_in_order(bpe, tmp_path):
    from tokenizers import Tokenizer

    path, files = bpe
    out = tmp_path / "tokens.npy"
    r = zjax_main("tokenize", *map(str, files[:12]), "-o", str(out), "--tokenizer", str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    tok = Tokenizer.from_file(str(path))
    want = np.concatenate([tok.encode(f.read_text(encoding="utf-8", errors="replace"),
                                      add_special_tokens=False).ids for f in files[:12]])
    got = np.load(out, mmap_mode="r")
    assert got.dtype == np.uint16 and np.array_equal(got, want)
    assert f"{len(want):,} tokens of 12 files" in r.stdout
    # BPE compresses code: fewer tokens than bytes, and the ids decode back to the text
    n_bytes = sum(len(f.read_bytes()) for f in files[:12])
    assert len(want) < 0.6 * n_bytes
    first = len(tok.encode(files[0].read_text(), add_special_tokens=False).ids)
    assert tok.decode(got[:first].tolist()) == files[0].read_text()
    # never replaced; a missing tokenizer names the flag; exit 2 without a traceback
    again = zjax_main("tokenize", str(files[0]), "-o", str(out), "--tokenizer", str(path))
    missing = zjax_main("tokenize", str(files[0]), "-o", str(tmp_path / "b.npy"),
                        "--tokenizer", str(tmp_path / "nope.json"))
    for bad, needle in ((again, "already exists"), (missing, "--tokenizer: ")):
        assert bad.returncode == 2 and needle in bad.stderr and "Traceback" not in bad.stderr


def test_data_tokenizer_encodes_text_and_sets_the_vocabulary(bpe, tmp_path):
    path, files = bpe
    tokens = load_tokens(str(files[0]), tokenizer=str(path), eval_fraction=0.1)
    assert tokens.vocab_size == 512 and tokens.train.max() < 512
    assert len(tokens.train) + len(tokens.eval) < len(files[0].read_bytes())
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.path={files[0]}",
                                                  f"data.tokenizer={path}"])
    from zjax.task.loop import LanguageModel

    with pytest.raises(zjax.ConfigError, match=r"^model.vocab_size: 256, but .* up to 511"):
        LanguageModel().check(cfg.model, cfg.data)
    with pytest.raises(zjax.ConfigError, match=r"^data.tokenizer: .*nope.json' is not a file"):
        load_tokens(str(files[0]), tokenizer=str(tmp_path / "nope.json"))


@pytest.mark.slow
def test_train_on_tokenized_data(bpe, tmp_path):
    path, files = bpe
    out = tmp_path / "tokens.npy"
    r = zjax_main("tokenize", *map(str, files), "-o", str(out), "--tokenizer", str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"data.path={out}", f"data.tokenizer={path}", "model.vocab_size=512",
        "train.steps=30", "train.log_every=10", "train.eval_every=0", "data.seq_len=64",
        "model.max_seq_len=64"])
    history = zjax.train(None, cfg).history
    assert history[-1]["loss"] < min(history[0]["loss"], np.log(512) - 1.0), history
