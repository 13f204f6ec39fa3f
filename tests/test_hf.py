"""Hugging Face weights in and out: zjax's Llama and GPT-2 against transformers' own on the
same weights (fp32 logits, atol 1e-5), the start of a stage-3 fine-tune from the files (read into
shards), the export that transformers loads back, and the errors for files that do not fit.

The Hugging Face side is transformers 4.57's ``FlaxLlamaForCausalLM`` (no torch, nothing
downloaded); the files are PyTorch-layout, as on the Hub (tests/hf_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import run_zjax
from hf_models import TINY_HF, hf_gpt2, hf_logits, hf_model, pt_layout, write_hf

import zjax
from zjax.checkpoint._leaf_io import nested
from zjax.config import load_config
from zjax.errors import CheckpointError, ConfigError
from zjax.export import export
from zjax.hf import HFCheckpoint, SafetensorsDir, import_hf
from zjax.models import model_class

ATOL = 1e-5  # fp32 logits of O(1): the same math in another op order
TOKENS = np.random.default_rng(1).integers(0, TINY_HF["vocab_size"], (2, 24))


def _zjax_logits(cfg, params, tokens=TOKENS) -> np.ndarray:
    """Logits of zjax's reference model of ``cfg`` (GPT or Llama) with ``params``."""
    cls = model_class(cfg)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    return np.asarray(nnx.merge(graphdef, jax.device_get(params))(tokens))


@pytest.fixture(scope="module")
def model():
    return hf_model()


@pytest.mark.parametrize("shards", [pytest.param(1, marks=pytest.mark.slow), 3])  # quick: 3
def test_imported_llama_has_transformers_logits(tmp_path, model, shards):
    directory = write_hf(tmp_path / "hf", model, shards=shards)
    source = HFCheckpoint(directory)
    got = _zjax_logits(source.config, nested(source.host_leaves()))
    np.testing.assert_allclose(got, hf_logits(model, TOKENS), atol=ATOL, rtol=0)


def test_test_files_are_what_transformers_reads(tmp_path, model):
    """transformers' own PyTorch->Flax converter reads the test's files back to the same
    model: the files follow Hugging Face's layout, not just zjax's reading of it."""
    from transformers import FlaxLlamaForCausalLM

    directory = write_hf(tmp_path / "hf", model)
    again = FlaxLlamaForCausalLM.from_pretrained(directory)
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


def test_tied_embeddings_read_the_embedding_as_head(tmp_path, model):
    # transformers' Flax Llama cannot tie; an untied one whose head is the embedding is the
    # same function, and its file (tied, no lm_head) is what a tied checkpoint holds
    tied = hf_model()
    tied.params["lm_head"]["kernel"] = tied.params["model"]["embed_tokens"]["embedding"].T
    tied.config.tie_word_embeddings = True
    source = HFCheckpoint(write_hf(tmp_path / "hf", tied))
    assert source.config.tie_embeddings and "head" not in nested(source.host_leaves())
    got = _zjax_logits(source.config, nested(source.host_leaves()))
    np.testing.assert_allclose(got, hf_logits(tied, TOKENS), atol=ATOL, rtol=0)


@pytest.mark.parametrize("strip", ["", "transformer."])
def test_imported_gpt2_has_transformers_logits(tmp_path, strip):
    """GPT-2: fused q/k/v, Conv1D [in, out], LayerNorm and biases, tied head; also the
    original Hub layout without the ``transformer.`` prefix."""
    from transformers import FlaxGPT2LMHeadModel

    gpt2 = hf_gpt2()
    directory = write_hf(tmp_path / "hf", gpt2, strip=strip, shards=2)
    source = HFCheckpoint(directory)
    assert source.layout.loop == "lm" and source.config.bias
    got = _zjax_logits(source.config, nested(source.host_leaves()))
    np.testing.assert_allclose(got, hf_logits(gpt2, TOKENS), atol=ATOL, rtol=0)
    if not strip:  # the test's file is what transformers itself reads as this model
        single = write_hf(tmp_path / "one", gpt2)
        again = FlaxGPT2LMHeadModel.from_pretrained(single)
        np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(gpt2, TOKENS))


@pytest.mark.slow
def test_gpt2_finetune_exports_what_transformers_loads(tmp_path):
    from transformers import FlaxGPT2LMHeadModel

    gpt2 = hf_gpt2()
    out = import_hf(write_hf(tmp_path / "hf", gpt2), tmp_path / "imported")
    config = load_config(out / "zjax.yaml", [
        "train.steps=3", "zero.stage=3", "data.seq_len=32", "data.batch_size=8",
        "train.eval_every=0", "logging.progress=false", "mesh.data=4", "mesh.model=2"])
    assert config.loop == "lm" and config.model.norm == "layer"
    result = zjax.train(None, config, run_dir=tmp_path / "run")
    tuned = _zjax_logits(config.model, result.state.params)
    assert np.abs(tuned - hf_logits(gpt2, TOKENS)).max() > 1e-3  # it did train
    exported = export(tmp_path / "run", tmp_path / "hf_out", dtype="float32", format="hf")
    reloaded = FlaxGPT2LMHeadModel.from_pretrained(exported)
    np.testing.assert_allclose(hf_logits(reloaded, TOKENS), tuned, atol=ATOL, rtol=0)


def test_stage3_start_reads_each_shard_from_the_files(tmp_path, model):
    from zjax.task._build import build_step

    directory = write_hf(tmp_path / "hf", model, shards=2)
    config = load_config(None, ["loop=llama", f"train.init_from={directory}", "zero.stage=3",
                                *_model_overrides()])
    zstep = build_step(config)
    from zjax.hf import initial_params

    params = initial_params(directory, zstep.params_target, config.model)
    wq = params["blocks"]["layers"]["wq"]
    assert {s.data.size for s in wq.addressable_shards} == {wq.size // 8}  # split over data
    state = zstep.from_params(params)
    expected = nested(HFCheckpoint(directory).host_leaves())
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), expected)
    assert int(state.step) == 0


def _model_overrides() -> list[str]:
    return ["model.vocab_size=256", "model.d_model=64", "model.n_layers=3", "model.n_heads=4",
            "model.n_kv_heads=2", "model.d_ff=80", "model.max_seq_len=64",
            "model.norm_eps=1e-5", "data.seq_len=32", "data.batch_size=8"]


def test_init_from_refuses_another_shape(tmp_path, model):
    directory = write_hf(tmp_path / "hf", model)
    overrides = [o if not o.startswith("model.d_ff") else "model.d_ff=96"
                 for o in _model_overrides()]
    config = load_config(None, ["loop=llama", f"train.init_from={directory}", "train.steps=1",
                                *overrides])
    with pytest.raises(ConfigError, match=r"model.d_ff: 96, but the weights .* have 80"):
        zjax.train(None, config)


def test_an_import_refuses_a_changed_model_value(tmp_path, model):
    """Shapes cannot show a changed epsilon or rotary base: the import's config.json does."""
    out = import_hf(write_hf(tmp_path / "hf", model), tmp_path / "imported")
    config = load_config(out / "zjax.yaml", ["model.norm_eps=1e-6", "train.steps=1",
                                             "data.batch_size=8", "data.seq_len=32"])
    with pytest.raises(ConfigError, match=r"model.norm_eps: 1e-06, but the weights .* have "
                                          r"1e-05"):
        zjax.train(None, config)


@pytest.mark.slow
def test_import_finetune_export_round_trip(tmp_path, model):
    """import-hf -> a stage-3 fine-tune of a few steps -> export --format hf, which
    transformers loads with the fine-tuned model's logits; a sharded export holds the same
    tensors in several files."""
    out = import_hf(write_hf(tmp_path / "hf", model), tmp_path / "imported")
    config = load_config(out / "zjax.yaml", [
        "train.steps=4", "zero.stage=3", "data.seq_len=32", "data.batch_size=8",
        "train.eval_every=0", "train.log_every=1", "logging.progress=false"])
    result = zjax.train(None, config, run_dir=tmp_path / "run")
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < losses[0] - 0.05, losses
    tuned = _zjax_logits(config.model, result.state.params)
    assert np.abs(tuned - hf_logits(model, TOKENS)).max() > 1e-3  # it did train

    from transformers import FlaxLlamaForCausalLM

    single = export(tmp_path / "run", tmp_path / "hf_out", dtype="float32", format="hf")
    assert json.loads((single / "config.json").read_text())["num_key_value_heads"] == 2
    reloaded = FlaxLlamaForCausalLM.from_pretrained(single)
    np.testing.assert_allclose(hf_logits(reloaded, TOKENS), tuned, atol=ATOL, rtol=0)

    sharded = export(tmp_path / "run", tmp_path / "hf_sharded", dtype="float32",
                     format="hf", max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one, many = SafetensorsDir(single), SafetensorsDir(sharded)
    assert sorted(one.names()) == sorted(many.names()) == sorted(pt_layout(model.params))
    for name in one.names():
        np.testing.assert_array_equal(one.array(name), many.array(name))


def _corrupt(directory: Path, change) -> Path:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.2.mlp.up_proj.weight"),
     r"tensor 'model.layers.2.mlp.up_proj.weight' is missing"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 60),
                                                                            np.float32)}),
     r"'model.layers.0.self_attn.q_proj.weight' has shape \[64, 60\]; config.json implies "
     r"\[64, 64\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
     r"no place for, e.g. 'model.layers.0.self_attn.q_proj.bias' \(another architecture, "
     r"or a feature zjax lacks\)"),
])
def test_files_that_do_not_fit_are_named(tmp_path, model, change, message):
    directory = _corrupt(write_hf(tmp_path / "hf", model), change)
    with pytest.raises(CheckpointError, match=message):
        HFCheckpoint(directory)


def test_unsupported_config_and_truncated_file_are_named(tmp_path, model):
    directory = write_hf(tmp_path / "hf", model)
    config = json.loads((directory / "config.json").read_text())
    scaled = {**config, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}
    (directory / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(CheckpointError, match=r"rope_scaling = .*dynamic.* not supported"):
        HFCheckpoint(directory)
    (directory / "config.json").write_text(json.dumps(config))
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* does not fit "
                       r"its offsets .*truncated or damaged"):
        HFCheckpoint(directory)


def test_llama31_rope_scaling_maps_both_ways():
    from zjax.hf import layout_for_hf

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = {**{k: v for k, v in TINY_HF.items()}, "model_type": "llama", "rope_scaling": scaling}
    layout = layout_for_hf(hf, source="config.json")
    cfg = layout.from_hf(hf, source="config.json")
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == ("llama3", 32, 8192)
    assert layout.to_hf(cfg, dtype="bfloat16")["rope_scaling"] == scaling


def test_cli_import_hf_errors_exit_2_and_write_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    r = run_zjax("import-hf", str(tmp_path / "empty"), str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert "no config.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # quick loop: 7 s
def test_export_hf_refuses_a_gpt_without_gpt2s_layout(tmp_path):
    run = tmp_path / "run"
    zjax.train("lm", {"train": {"steps": 1, "eval_every": 0}, "logging": {"progress": False},
                      "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
                      "data": {"seq_len": 16, "batch_size": 8}}, run_dir=run)
    with pytest.raises(ConfigError, match=r"--format: hf writes the reference GPT as "
                       r"GPT2LMHeadModel, which needs model.norm: layer.*the run has "
                       r"model.norm: 'rms', model.bias: False"):
        export(run, tmp_path / "out", format="hf")
    assert not (tmp_path / "out").exists()
