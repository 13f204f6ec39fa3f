"""Hugging Face models under hostile use (issue 31): the exported model keeps the original's
identity (``config.json``'s token ids and every key training does not change,
``generation_config.json``), a directory holding both a single file and an index is read as
transformers reads it, a tokenizer with ids past the model's vocabulary is refused wherever the
pair is formed, NaN weights are refused naming the tensor, and a disk that fills during
``import-hf`` is one error line with nothing left behind."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import uuid
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import zjax_main
from hf_models import TINY_HF, hf_logits, hf_model, write_hf

import zjax
from zjax.config import load_config
from zjax.errors import CheckpointError, ConfigError
from zjax.export import export
from zjax.export.sample import load_sampler
from zjax.hf import HFCheckpoint, import_hf

ATOL = 1e-5  # as tests/test_hf.py: fp32 logits of O(1)
TOKENS_HF = np.random.default_rng(1).integers(0, TINY_HF["vocab_size"], (2, 12))
# what a Hub config.json carries beyond the architecture: ids, and keys zjax has no use for
IDENTITY = {"bos_token_id": 7, "eos_token_id": [9, 11], "pad_token_id": 3,
            "initializer_range": 0.05, "attention_dropout": 0.0, "pretraining_tp": 1,
            "max_position_embeddings": 4096, "use_cache": True, "custom_key": {"kept": [1, 2]}}
GENERATION = {"bos_token_id": 7, "eos_token_id": [9, 11], "do_sample": True,
              "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.57.0"}


def _wordlevel(path: Path, n: int) -> Path:
    """A whitespace word-level ``tokenizer.json`` with ids ``0 .. n - 1``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _hub_dir(directory: Path, model, *, tokenizer_ids: int | None = None) -> Path:
    """``write_hf`` plus the identity a Hub checkpoint carries (and a tokenizer)."""
    write_hf(directory, model)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **IDENTITY}, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    if tokenizer_ids is not None:
        _wordlevel(directory / "tokenizer.json", tokenizer_ids)
    return directory


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("zjax")]
    assert len(lines) == 1 and lines[0].startswith("zjax: error: "), r.stderr[-2000:]
    assert r.stderr.rstrip().endswith(lines[0])
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def small():
    return hf_model(num_hidden_layers=1)


@pytest.mark.slow  # trains a run
def test_export_keeps_the_originals_config_and_generation_config(tmp_path, small):
    """import-hf -> a step -> export --format hf: config.json is the original's
    (token ids, unknown keys, max_position_embeddings though the run trained at 2048) but
    for the weights' dtype, generation_config.json comes back byte for byte, and transformers
    reads the ids back. Then a tokenizer swapped for one past the vocabulary is refused, and
    so is the export once the import it started from is gone."""
    from transformers import GenerationConfig, LlamaConfig

    hf = _hub_dir(tmp_path / "hf", small, tokenizer_ids=200)
    original = json.loads((hf / "config.json").read_text())
    imported = import_hf(hf, tmp_path / "imported")
    assert (imported / "generation_config.json").read_bytes() == \
        (hf / "generation_config.json").read_bytes()
    config = load_config(imported / "zjax.yaml", [
        "train.steps=1", "zero.stage=0", "data.seq_len=16", "data.batch_size=8",
        "train.eval_every=0", "logging.progress=false", "logging.tensorboard=false"])
    assert config.model.max_seq_len == 4096  # the config's max_position_embeddings
    zjax.train(None, config, run_dir=tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "out", dtype="bfloat16", format="hf")
    got = json.loads((out / "config.json").read_text())
    dtypes = {k: "bfloat16" for k in ("torch_dtype", "dtype") if k in original} or \
        {"torch_dtype": "bfloat16"}
    assert got == {**original, **dtypes}
    assert (out / "generation_config.json").read_bytes() == \
        (hf / "generation_config.json").read_bytes()
    assert LlamaConfig.from_pretrained(out).eos_token_id == [9, 11]
    assert GenerationConfig.from_pretrained(out).temperature == 0.6

    _wordlevel(imported / "tokenizer.json", 300)  # the run's data.tokenizer, swapped
    with pytest.raises(ConfigError, match=r"tokenizer.json: the tokenizer has token ids up "
                                          r"to 299, but the run's model .* vocabulary of 256"):
        export(tmp_path / "run", tmp_path / "out2", format="hf")
    assert not (tmp_path / "out2").exists()

    # without the directory it started from, the export would lose the original's ids
    imported.rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match=r"train.init_from .*imported, which is gone; "
                                              r"its config.json and generation_config.json"):
        export(tmp_path / "run", tmp_path / "out3", format="hf")
    assert not (tmp_path / "out3").exists()


def test_a_single_file_beside_an_index_is_read_as_transformers_reads_it(tmp_path, caplog):
    """model.safetensors (one model) and an index with its shards (another) in one
    directory: zjax reads the single file, as transformers' from_pretrained does, and says
    that the index is ignored."""
    from transformers import FlaxLlamaForCausalLM

    first, second = hf_model(seed=0, num_hidden_layers=1), hf_model(seed=1, num_hidden_layers=1)
    both = write_hf(tmp_path / "both", second, shards=2)
    write_hf(tmp_path / "both", first)  # model.safetensors beside the index
    assert (both / "model.safetensors.index.json").is_file()
    with caplog.at_level(logging.WARNING, logger="zjax"):
        source = HFCheckpoint(both)
    assert "holds both model.safetensors and model.safetensors.index.json" in caplog.text
    from zjax.checkpoint._leaf_io import nested
    from zjax.models import model_class

    cls = model_class(source.config)
    from flax import nnx

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(source.config, rngs=nnx.Rngs(0))))
    ours = np.asarray(nnx.merge(graphdef, nested(source.host_leaves()))(TOKENS_HF))
    theirs = hf_logits(FlaxLlamaForCausalLM.from_pretrained(both), TOKENS_HF)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ours, hf_logits(first, TOKENS_HF), atol=ATOL, rtol=0)


def test_a_tokenizer_past_the_vocabulary_is_refused_by_import_and_sample(tmp_path, small):
    """The pair is checked where it is formed: import-hf (exit 2, nothing written) and
    sample from the Hugging Face directory or from an import whose tokenizer was swapped."""
    hf = _hub_dir(tmp_path / "hf", small, tokenizer_ids=300)
    before = _listing(hf)
    r = zjax_main("import-hf", str(hf), str(tmp_path / "imported"))
    _one_line(r, "tokenizer.json: the tokenizer has token ids up to 299",
              "vocabulary of 256")
    assert not (tmp_path / "imported").exists() and _listing(hf) == before
    with pytest.raises(ConfigError, match=r"ids up to 299, but the model of .* vocabulary "
                                          r"of 256"):
        load_sampler(hf)
    _wordlevel(hf / "tokenizer.json", 256)  # fits exactly
    imported = import_hf(hf, tmp_path / "imported")
    assert load_sampler(imported).tokenizer is not None
    _wordlevel(imported / "tokenizer.json", 257)
    with pytest.raises(ConfigError, match=r"ids up to 256, but the model of"):
        load_sampler(imported)


def test_nan_weights_are_refused_naming_the_tensor(tmp_path, small):
    from safetensors.numpy import load_file, save_file

    hf = write_hf(tmp_path / "hf", small)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][3, :2] = [np.nan, np.inf]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' "
                                              r"holds 2 NaN or infinite values"):
        import_hf(hf, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()
    r = zjax_main("sample", str(hf), "--prompt", "hi", "--max-new-tokens", "2")
    _one_line(r, "down_proj.weight", "NaN or infinite")


@contextlib.contextmanager
def _small_disk(root: Path, nbytes: int):
    """A tmpfs of ``nbytes`` mounted at a new directory under ``root`` (needs root)."""
    mount = root / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(mount)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow  # five small disks and a CLI run
def test_import_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, small, capfd):
    """Disks that fill at every stage of the import (inside Orbax's writes, at the config
    files): each import either succeeds whole or raises one CheckpointError; the disk is left
    empty, and no traceback is printed (Orbax's writer threads log one for each error)."""
    hf = write_hf(tmp_path / "hf", small)
    weights = (hf / "model.safetensors").stat().st_size
    outcomes = []
    for fraction in (0.3, 1.3, 1.37, 1.45, 3.0):
        with _small_disk(tmp_path, int(weights * fraction) // 4096 * 4096) as disk:
            try:
                out = import_hf(hf, disk / "out")
                assert ocp.StandardCheckpointer().restore(out / "params")["embed"].shape == \
                    (256, 64)
                outcomes.append("ok")
            except CheckpointError as e:
                assert str(e).startswith(f"import-hf: cannot write '{disk / 'out'}': "), e
                assert "\n" not in str(e) and list(disk.iterdir()) == [], (e, disk)
                outcomes.append(str(e).split(": ")[-1])
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ERROR:absl" not in err, err[-3000:]
    assert outcomes[0] != "ok" and outcomes[-1] == "ok", outcomes
    with _small_disk(tmp_path, int(weights * 1.37) // 4096 * 4096) as disk:
        r = zjax_main("import-hf", str(hf), str(disk / "out"))
        _one_line(r, "import-hf: cannot write", "No space left on device")
        assert list(disk.iterdir()) == []
    # in-process, what Orbax's writer threads would print beside the CLI's line reaches fd 2
    # (or the stderr of before the CLI run): none of it is a traceback either
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ERROR:absl" not in err, err[-3000:]


def test_import_errors_name_import_hf(tmp_path, small):
    """An existing or unwritable OUT: import-hf's own messages, not export's."""
    hf = write_hf(tmp_path / "hf", small)
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match=r"^import-hf: '.*taken' already exists"):
        import_hf(hf, tmp_path / "taken")
    with pytest.raises(CheckpointError, match=r"^import-hf: cannot write '.*out': its parent"):
        import_hf(hf, tmp_path / "missing" / "out")
