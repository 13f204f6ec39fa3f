"""Sampling a Hugging Face model (issue 50, items 7 and 8): a model whose only tokenizer is a
slow one, or none, is never sampled byte-level (refused naming the missing tokenizer.json and
how to write it), and generation stops at any of the model's end-of-sequence ids
(generation_config.json's list, config.json's, the tokenizer's eos_token), as transformers'
generate stops; the decoding loop ends once every row has."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_reliability_hf import _cli, _llama_dir, _one_error, _wordlevel

from zjax import cli
from zjax.errors import CheckpointError
from zjax.export.sample import generate, load_sampler, until_stop
from zjax.hf import import_hf, stop_ids

# ---- item 7: never byte-level for a Hugging Face model -------------------------------------

@pytest.mark.parametrize("slow", [("tokenizer.model",), ("vocab.json", "merges.txt")])
def test_a_slow_tokenizer_alone_is_refused_by_import_and_sample(tmp_path, capsys, cli_logging,
                                                                slow):
    directory = _llama_dir(tmp_path / "hf")
    for name in slow:
        (directory / name).write_bytes(b"\x0a\x05slow")
    rc, err = _cli(capsys, "import-hf", directory, tmp_path / "out")
    _one_error(rc, err, slow[0], "no tokenizer.json", "save_pretrained")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    rc, err = _cli(capsys, "sample", directory, "--prompt", "w1 w2", "--max-new-tokens", "2")
    _one_error(rc, err, slow[0], "no tokenizer.json")


def test_a_model_with_no_tokenizer_imports_with_a_warning_and_is_not_sampled(tmp_path, capsys,
                                                                             cli_logging):
    directory = _llama_dir(tmp_path / "hf")
    rc = cli.main(["import-hf", str(directory), str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0 and "has no tokenizer.json" in out, out
    text = (tmp_path / "out" / "zjax.yaml").read_text()
    assert "no tokenizer.json" in text and "tokenizer:" not in text
    for source in (directory, tmp_path / "out"):
        rc, err = _cli(capsys, "sample", source, "--prompt", "hello", "--max-new-tokens", "2")
        _one_error(rc, err, "no tokenizer.json", "not bytes")
    # the model itself still generates from ids (a program that tokenizes elsewhere)
    sampler = load_sampler(directory)
    assert generate(sampler.model, np.asarray([[1, 2]]), max_new_tokens=2, temperature=0,
                    key=jax.random.key(0)).shape == (1, 2)


def test_a_tokenizer_json_beside_a_slow_one_is_used_and_kept(tmp_path):
    directory = _llama_dir(tmp_path / "hf")
    (directory / "tokenizer.model").write_bytes(b"\x0a\x05slow")
    _wordlevel(directory / "tokenizer.json")
    out = import_hf(directory, tmp_path / "out")
    assert (out / "tokenizer.model").read_bytes() == b"\x0a\x05slow"
    assert load_sampler(out).tokenizer is not None


# ---- item 8: stop at any end-of-sequence id --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Cfg:
    max_seq_len: int = 64


class _Counter(nnx.Module):
    """A model whose next token is the last one plus 1 (mod 32), certainly."""

    def __init__(self):
        self.cfg = _Cfg()
        self.unit = nnx.Param(jnp.ones(()))

    def init_cache(self, batch: int, length: int):
        return jnp.zeros((batch, length))

    def decode(self, tokens, cache, start):
        return 10.0 * self.unit * jax.nn.one_hot((tokens + 1) % 32, 32), cache


def test_the_decoding_loop_stops_at_each_stop_id_and_ends_when_every_row_has():
    model = _Counter()
    prompt = np.asarray([[3], [10]])
    for stop in ([6], [12, 6], [99, 6, 12]):
        rows = generate(model, prompt, max_new_tokens=8, temperature=0,
                        key=jax.random.key(0), stop=stop)
        cut = [until_stop(row, set(stop)) for row in rows]
        assert cut[0] == [4, 5] and cut[1] == ([11] if 12 in stop else list(range(11, 19)))
    rows = generate(model, prompt, max_new_tokens=8, temperature=0, key=jax.random.key(0),
                    stop=[6, 12])
    # row 0 stops at its 3rd token, row 1 at its 2nd: the loop ends after 3 tokens
    np.testing.assert_array_equal(rows, [[4, 5, 6, -1, -1, -1, -1, -1],
                                         [11, 12, 13, -1, -1, -1, -1, -1]])
    full = generate(model, prompt, max_new_tokens=8, temperature=0, key=jax.random.key(0))
    np.testing.assert_array_equal(full[0], range(4, 12))  # no stop ids: every token


def test_stop_ids_come_from_generation_config_config_and_tokenizer(tmp_path):
    tk_path = _wordlevel(tmp_path / "tokenizer.json", eos="w7")
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tk_path))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    assert stop_ids(tmp_path, tk, tk_path) == (9, 11, 2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert stop_ids(tmp_path, None, None) == (2,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CheckpointError, match=r"config.json: eos_token_id = '</s>'"):
        stop_ids(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"config\.json: not readable JSON"):
        stop_ids(tmp_path)


def test_sample_and_chat_stop_at_any_id_of_generation_configs_list(tmp_path, capsys,
                                                                  cli_logging):
    directory = _llama_dir(tmp_path / "hf")
    tk_path = _wordlevel(directory / "tokenizer.json")
    free = load_sampler(directory)
    ids = free.encode("w1 w2 w3")
    tokens = generate(free.model, np.asarray([ids]), max_new_tokens=8, temperature=0,
                      key=jax.random.key(0))[0].tolist()
    k = next(i for i in range(1, 8) if tokens[i] not in tokens[:i])  # first new id, not first
    config = {"eos_token_id": [255, tokens[k]], "chat_template":
              "{% for m in messages %}{{ m['content'] }} {% endfor %}"}
    (directory / "generation_config.json").write_text(json.dumps(config))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": config["chat_template"]}))
    want = free.tokenizer.decode(tokens[:k])
    sampler = load_sampler(directory)
    assert sampler("w1 w2 w3", max_new_tokens=8, temperature=0) == [want]
    assert sampler.chat("w1 w2 w3", max_new_tokens=8, temperature=0, n=2) == [want, want]
    rc = cli.main(["sample", str(directory), "--prompt", "w1 w2 w3", "--temperature", "0",
                   "--max-new-tokens", "8"])
    assert rc == 0 and capsys.readouterr().out.strip().endswith("w1 w2 w3" + want)
    assert tk_path.is_file()
