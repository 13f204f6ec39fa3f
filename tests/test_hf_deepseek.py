"""``DeepseekV3ForCausalLM`` in and out (``zjax.hf._deepseek``).

- A tiny DeepSeek-V3 made by transformers' ``DeepseekV3Config`` (3 layers, the first dense,
  latent attention with a query latent or one ``q_proj``, 4 experts in 2 groups, a shared
  expert, a random correction bias; also YaRN with DeepSeek's ``mscale_all_dim``) imports and
  gives the logits of a float64 transcription of transformers' model (``tests/hf_deepseek.py``)
  and its greedy tokens through zjax's cached decoding.
- import-hf -> 2 ZeRO-3 steps over ``data`` 4 x ``expert`` 2 -> export --format hf: the files
  hold the trained model (by the reference's forward), under the same ``config.json``.
- ``DeepseekV2ForCausalLM`` (V2-Lite's shape: one ``q_proj``, a softmax ``greedy`` gate; and
  V2's ``group_limited_greedy`` with a scaling factor) the same, exported back to the same
  ``config.json`` and tensors. With YaRN, zjax follows DeepSeek's code (the softmax scale times
  ``mscale(factor, mscale_all_dim)^2``, as V3 and later transformers do), not transformers
  4.57's ``DeepseekV2Attention``, which leaves it out: the test shows both.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx
from hf_deepseek import (
    deepseek_config,
    deepseek_greedy,
    deepseek_logits,
    deepseek_tensors,
    deepseek_v2_config,
)
from hf_reference import write_checkpoint

import zjax
from zjax.checkpoint._leaf_io import nested
from zjax.config import load_config
from zjax.export import export
from zjax.export.sample import generate, load_sampler
from zjax.hf import HFCheckpoint, SafetensorsDir, import_hf
from zjax.models import model_class

TOKENS = np.random.default_rng(1).integers(0, 96, (2, 12))
ATOL = 2e-4


def _zjax_logits(directory) -> np.ndarray:
    source = HFCheckpoint(directory)
    cls = model_class(source.config)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(source.config, rngs=nnx.Rngs(0))))
    return np.asarray(nnx.merge(graphdef, nested(source.host_leaves()))(TOKENS))


@pytest.mark.parametrize("changes", [  # the quick loop: q-latent (DeepSeek-V3's)
    {}, pytest.param({"q_lora_rank": None}, marks=pytest.mark.slow),
    pytest.param({"rope_scaling": {"type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 6, "beta_fast": 8.0,
                                   "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
                 marks=pytest.mark.slow),
], ids=["q-latent", "q-proj", "yarn"])
def test_imported_deepseek_gives_the_reference_logits_and_tokens(tmp_path, changes):
    hf = deepseek_config(**changes)
    tensors = deepseek_tensors(hf)
    directory = write_checkpoint(tmp_path / "hf", hf, tensors)
    assert HFCheckpoint(directory).layout.architecture == "DeepseekV3ForCausalLM"
    want = deepseek_logits(hf, tensors, TOKENS)
    np.testing.assert_allclose(_zjax_logits(directory), want, atol=ATOL, rtol=0)
    sampler = load_sampler(directory)
    prompt = TOKENS[:, :6]
    ours = generate(sampler.model, prompt, max_new_tokens=6, temperature=0,
                    key=jax.random.key(0))
    np.testing.assert_array_equal(ours, deepseek_greedy(hf, tensors, prompt, 6))


@pytest.mark.slow
def test_import_train_export_gives_the_trained_model(tmp_path):
    hf = deepseek_config()
    tensors = deepseek_tensors(hf)
    directory = write_checkpoint(tmp_path / "hf", hf, tensors)
    out = import_hf(directory, tmp_path / "imported")
    config = load_config(out / "zjax.yaml", [
        "train.steps=2", "zero.stage=3", "mesh.expert=2", "data.seq_len=32",
        "data.batch_size=8", "train.eval_every=0", "train.log_every=1",
        "logging.progress=false", "zero.gather_dtype=float32", "zero.reduce_dtype=float32",
        "model.router_bias_update_speed=0.01"])
    result = zjax.train(None, config, run_dir=tmp_path / "run")
    cls = model_class(config.model)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(config.model, rngs=nnx.Rngs(0))))
    tuned = np.asarray(nnx.merge(graphdef, jax.device_get(result.state.params))(TOKENS))
    assert np.abs(tuned - deepseek_logits(hf, tensors, TOKENS)).max() > 1e-3  # it trained
    exported = export(tmp_path / "run", tmp_path / "out", dtype="float32", format="hf")
    written = json.loads((exported / "config.json").read_text())
    assert {k: written[k] for k in hf if k != "torch_dtype"} == {
        k: v for k, v in hf.items() if k != "torch_dtype"}
    files = SafetensorsDir(exported)
    assert sorted(files.names()) == sorted(tensors)
    got = {n: files.array(n) for n in files.names()}
    trained = np.asarray(jax.device_get(result.state.params)["blocks"]["layers"]["router_bias"])
    names = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    np.testing.assert_array_equal(np.stack([got[n] for n in names]), trained)  # written
    assert np.abs(trained - np.stack([tensors[n] for n in names])).max() > 0.005  # it moved
    np.testing.assert_allclose(deepseek_logits(written, got, TOKENS), tuned, atol=ATOL, rtol=0)


@pytest.mark.slow  # an import, a step and an export (14 s); V3's import stays in the quick loop
@pytest.mark.parametrize("changes", [
    {}, pytest.param({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
                      "routed_scaling_factor": 2.0}, marks=pytest.mark.slow),
], ids=["v2-lite-greedy", "v2-group-limited"])
def test_deepseek_v2_imports_and_exports_as_itself(tmp_path, changes):
    hf = deepseek_v2_config(**changes)
    tensors = deepseek_tensors(hf)
    directory = write_checkpoint(tmp_path / "hf", hf, tensors)
    assert HFCheckpoint(directory).layout.architecture == "DeepseekV2ForCausalLM"
    np.testing.assert_allclose(_zjax_logits(directory), deepseek_logits(hf, tensors, TOKENS),
                               atol=ATOL, rtol=0)
    sampler = load_sampler(directory)
    prompt = TOKENS[:, :6]
    ours = generate(sampler.model, prompt, max_new_tokens=6, temperature=0,
                    key=jax.random.key(0))
    np.testing.assert_array_equal(ours, deepseek_greedy(hf, tensors, prompt, 6))
    out = import_hf(directory, tmp_path / "imported")
    config = load_config(out / "zjax.yaml", ["train.steps=1", "data.seq_len=16",
                                             "data.batch_size=8", "train.eval_every=0"])
    result = zjax.train(None, config, run_dir=tmp_path / "run")
    cls = model_class(config.model)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(config.model, rngs=nnx.Rngs(0))))
    tuned = np.asarray(nnx.merge(graphdef, jax.device_get(result.state.params))(TOKENS))
    exported = export(tmp_path / "run", tmp_path / "out", dtype="float32", format="hf")
    written = json.loads((exported / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV2ForCausalLM"]
    assert {k: written[k] for k in hf if k != "torch_dtype"} == {
        k: v for k, v in hf.items() if k != "torch_dtype"}
    files = SafetensorsDir(exported)
    assert sorted(files.names()) == sorted(tensors)
    got = deepseek_logits(written, {n: files.array(n) for n in files.names()}, TOKENS)
    np.testing.assert_allclose(got, tuned, atol=ATOL, rtol=0)  # the trained model, written


def test_deepseek_v2_yarn_takes_deepseeks_softmax_scale(tmp_path):
    hf = deepseek_v2_config(rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6, "beta_fast": 8.0,
        "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.707})
    tensors = deepseek_tensors(hf)
    got = _zjax_logits(write_checkpoint(tmp_path / "hf", hf, tensors))
    np.testing.assert_allclose(got, deepseek_logits(hf, tensors, TOKENS, deepseek_scale=True),
                               atol=ATOL, rtol=0)
    assert np.abs(got - deepseek_logits(hf, tensors, TOKENS)).max() > 1e-3  # transformers'


def test_a_kimi_k2_config_reads_as_deepseek_v3(tmp_path):
    """Kimi K2's ``config.json`` names ``DeepseekV3ForCausalLM`` under its own model_type (its
    remote code's config class), one expert group, DeepSeek's keys beside: the same model."""
    hf = {**deepseek_config(n_group=1, topk_group=1, num_nextn_predict_layers=0),
          "model_type": "kimi_k2",
          "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    tensors = deepseek_tensors(hf)
    directory = write_checkpoint(tmp_path / "hf", hf, tensors)
    assert HFCheckpoint(directory).layout.architecture == "DeepseekV3ForCausalLM"
    np.testing.assert_allclose(_zjax_logits(directory), deepseek_logits(hf, tensors, TOKENS),
                               atol=ATOL, rtol=0)


def test_multi_token_prediction_layers_are_left_as_transformers_leaves_them(tmp_path, caplog):
    """DeepSeek-V3's checkpoints hold its multi-token-prediction layer after the last one
    (``model.layers.{num_hidden_layers}.*``); transformers' model reads none of it, and zjax
    imports the rest with a warning naming it; a stray tensor elsewhere is still refused."""
    import logging

    from zjax.errors import CheckpointError

    hf = deepseek_config(num_nextn_predict_layers=1)
    tensors = deepseek_tensors(hf)
    mtp = {"model.layers.3.enorm.weight": np.ones(64, np.float32),
           "model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32),
           "model.layers.3.self_attn.kv_a_layernorm.weight": np.ones(16, np.float32)}
    directory = write_checkpoint(tmp_path / "hf", hf, {**tensors, **mtp})
    with caplog.at_level(logging.WARNING, logger="zjax"):
        got = _zjax_logits(directory)
    assert "3 tensor(s) DeepseekV3ForCausalLM's model does not read" in caplog.text
    np.testing.assert_allclose(got, deepseek_logits(hf, tensors, TOKENS), atol=ATOL, rtol=0)
    stray = write_checkpoint(tmp_path / "stray", hf,
                             {**tensors, "model.layers.1.mlp.extra.weight": np.ones(4)})
    with pytest.raises(CheckpointError, match="zjax's model has no place for"):
        HFCheckpoint(stray)
