"""Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1/2/3, Mixtral and Qwen3-MoE checkpoints in and
out: zjax's logits
equal a float64 reference written from transformers' modelling files (itself checked against
transformers' Flax Llama, Mistral and Gemma), greedy generation equals token for token, every
``config.json`` key that transformers' config class writes is mapped, fixed or inert, and each
mapped key changes the logits or is refused when changed.

Tolerance: 1e-4 on fp32 logits of O(1) against float64 (the issue's bound; measured 1e-6 to
1.2e-5, Gemma 3's on logits up to 5.4)."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_replicas_identical
from hf_reference import FAMILIES, greedy, logits, random_tensors, tiny_config, write_checkpoint

import zjax
from zjax.checkpoint._leaf_io import nested
from zjax.config import load_config
from zjax.errors import CheckpointError
from zjax.export import export
from zjax.export.sample import generate, load_sampler
from zjax.hf import HFCheckpoint, SafetensorsDir, import_hf, layout_for_hf
from zjax.models import model_class

ATOL = 1e-4
TOKENS = np.random.default_rng(1).integers(0, 96, (2, 12))


def zjax_logits(directory) -> np.ndarray:
    """Logits of zjax's model read from a Hugging Face directory."""
    source = HFCheckpoint(directory)
    cls = model_class(source.config)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(source.config, rngs=nnx.Rngs(0))))
    return np.asarray(nnx.merge(graphdef, nested(source.host_leaves()))(TOKENS))


def _flax(cls_name: str, hf: dict, tensors: dict):
    """transformers' Flax model of ``hf`` holding ``tensors`` (PyTorch names -> Flax's)."""
    import transformers
    from flax.traverse_util import unflatten_dict

    config = getattr(transformers, cls_name.replace("Flax", "").replace("ForCausalLM",
                                                                         "Config"))(**hf)
    model = getattr(transformers, cls_name)(config, seed=0, _do_init=True)
    flat = {}
    for name, x in tensors.items():
        keys = name.split(".")
        if keys[-1] == "weight":
            is_dense = x.ndim == 2 and "embed_tokens" not in name
            keys[-1] = "kernel" if is_dense else ("embedding" if x.ndim == 2 else "weight")
            x = x.T if is_dense else x
        flat[tuple(keys)] = x
    model.params = unflatten_dict(flat)
    return model


@pytest.mark.slow  # quick loop: 11 s
def test_the_reference_is_transformers_flax_llama_mistral_and_gemma():
    """The reference's Llama block and sliding window against transformers' own Flax models.
    Flax Mistral's mask (``triu(k=-window)``) lets a query see ``window + 1`` positions where
    the PyTorch model (the one checkpoints are trained with) sees ``window``: the reference
    follows PyTorch, so it is compared at window + 1. (Flax Llama ignores ``rope_theta``: 10000
    here.)"""
    hf = tiny_config("llama", rope_theta=10000.0)
    tensors = random_tensors(hf)
    ours = logits(hf, tensors, TOKENS)
    theirs = np.asarray(_flax("FlaxLlamaForCausalLM", hf, tensors)(TOKENS).logits)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    hf = tiny_config("mistral", sliding_window=4, rope_theta=10000.0)
    tensors = random_tensors(hf)
    theirs = np.asarray(_flax("FlaxMistralForCausalLM", hf, tensors)(TOKENS).logits)
    np.testing.assert_allclose(logits({**hf, "sliding_window": 5}, tensors, TOKENS), theirs,
                               atol=ATOL, rtol=0)
    assert np.abs(logits(hf, tensors, TOKENS) - theirs).max() > 1e-3  # the window matters
    hf = tiny_config("gemma", rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh")
    tensors = random_tensors(hf)
    theirs = np.asarray(_flax("FlaxGemmaForCausalLM", hf, tensors)(TOKENS).logits)
    np.testing.assert_allclose(logits(hf, tensors, TOKENS), theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_imported_logits_and_greedy_tokens_equal_the_reference(tmp_path, family):
    hf = tiny_config(family)
    tensors = random_tensors(hf)
    directory = write_checkpoint(tmp_path / family, hf, tensors)
    assert HFCheckpoint(directory).layout.architecture == hf["architectures"][0]
    np.testing.assert_allclose(zjax_logits(directory), logits(hf, tensors, TOKENS), atol=ATOL,
                               rtol=0)
    sampler = load_sampler(directory)
    prompt = TOKENS[:, :6]
    ours = generate(sampler.model, prompt, max_new_tokens=8, temperature=0,
                    key=jax.random.key(0))
    np.testing.assert_array_equal(ours, greedy(hf, tensors, prompt, 8))


# YaRN (Qwen's and DeepSeek's long context) at a small original length, so that the 12 tokens
# reach past it: transformers' defaults, DeepSeek's mscale pair with the ramp's own bounds
# untruncated, and an attention factor given outright
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6}
YARNS = [YARN, {**YARN, "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 1.0,
                "mscale_all_dim": 0.5, "truncate": False},
         {**YARN, "attention_factor": 0.8}]


def test_phi3_longrope_picks_its_factors_per_forward_as_transformers(tmp_path):
    """Phi-3's ``longrope``: a forward whose positions stay within
    ``original_max_position_embeddings`` (8) takes the short factors, one past it the long
    ones for every position (transformers' per-forward choice); the attention factor from
    ``max_position_embeddings / original``. Greedy tokens from a 6-token prompt stay short
    (cached decoding past the original length takes the long factors for the new positions
    only, as transformers' cache does; a full forward takes them for all). Exported back to
    the same ``rope_scaling`` and lengths."""
    short, long = [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0], [2.0, 3.0, 4.0, 6.0, 8.0, 10.0,
                                                           12.0, 16.0]  # 64 / 4 heads / 2
    hf = tiny_config("phi3", original_max_position_embeddings=8, max_position_embeddings=64,
                     rope_scaling={"type": "longrope", "short_factor": short,
                                   "long_factor": long})
    tensors = random_tensors(hf)
    directory = write_checkpoint(tmp_path / "hf", hf, tensors)
    cfg = HFCheckpoint(directory).config
    assert cfg.rope_scaling == "longrope" and cfg.rope_factor == 8.0
    source = HFCheckpoint(directory)
    cls = model_class(source.config)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(source.config, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, nested(source.host_leaves()))
    for tokens in (TOKENS[:, :8], TOKENS):  # 8 positions: short; 12: long
        np.testing.assert_allclose(np.asarray(model(tokens)), logits(hf, tensors, tokens),
                                   atol=ATOL, rtol=0)
    same = {**hf, "rope_scaling": {**hf["rope_scaling"], "long_factor": short}}
    assert np.abs(logits(same, tensors, TOKENS) - logits(hf, tensors, TOKENS)).max() > 1e-3
    sampler = load_sampler(directory)
    ours = generate(sampler.model, TOKENS[:, :4], max_new_tokens=4, temperature=0,
                    key=jax.random.key(0))
    np.testing.assert_array_equal(ours, greedy(hf, tensors, TOKENS[:, :4], 4))
    written = HFCheckpoint(directory).layout.to_hf(cfg, dtype="float32")
    assert written["rope_scaling"] == {"rope_type": "longrope", **{
        k: hf["rope_scaling"][k] for k in ("short_factor", "long_factor")}}
    assert (written["max_position_embeddings"], written["original_max_position_embeddings"]) \
        == (64, 8)


@pytest.mark.parametrize("scaling", YARNS, ids=["defaults", "deepseek", "factor"])
def test_yarn_scaled_logits_equal_the_reference_and_map_both_ways(tmp_path, scaling):
    hf = tiny_config("qwen2", rope_scaling=scaling)
    tensors = random_tensors(hf)
    ours = zjax_logits(write_checkpoint(tmp_path / "yarn", hf, tensors))
    want = logits(hf, tensors, TOKENS)
    np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)
    unscaled = logits({**hf, "rope_scaling": None}, tensors, TOKENS)
    assert np.abs(unscaled - want).max() > 100 * ATOL  # the scaling is seen
    layout = layout_for_hf(hf, source="config.json")
    cfg = layout.from_hf(hf, source="config.json")
    assert cfg.rope_scaling == "yarn" and cfg.rope_original_max_len == 6
    written = layout.to_hf(cfg, dtype="float32")["rope_scaling"]
    assert {k: v for k, v in written.items() if v != {"truncate": True}.get(k)} == \
        {k: v for k, v in scaling.items() if k != "type"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_key_transformers_writes_is_known(family, caplog):
    """No key of transformers' full config (defaults included) is unknown to zjax: each is
    mapped, held at the value zjax honours, or inert."""
    hf = tiny_config(family)
    import transformers

    full = {**getattr(transformers, FAMILIES[family][0])(**hf).to_dict(), **hf}
    with caplog.at_level(logging.WARNING, logger="zjax"):
        layout_for_hf(full, source="config.json").from_hf(full, source="config.json")
    assert not caplog.records, caplog.text


def _changed(key: str, hf: dict):
    """Another value of ``key`` that a checkpoint of ``hf`` could be read with."""
    hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {"vocab_size": hf["vocab_size"] + 8, "hidden_size": hf["hidden_size"] * 2,
            "num_hidden_layers": hf["num_hidden_layers"] - 1,
            "num_attention_heads": hf["num_attention_heads"] * 2,
            "num_key_value_heads": hf["num_key_value_heads"] * 2,
            "intermediate_size": hf["intermediate_size"] + 16,
            "rope_theta": hf["rope_theta"] * 10, "rms_norm_eps": 0.1,
            "tie_word_embeddings": not hf["tie_word_embeddings"], "head_dim": hd // 2,
            "rope_scaling": scaling, "sliding_window": 3,
            "hidden_act": "gelu" if hf.get("hidden_act") != "gelu" else "gelu_pytorch_tanh",
            "hidden_activation": "gelu" if hf.get("hidden_activation") != "gelu"
            else "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hd * 4, "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 0.5, "rope_local_base_freq": 10000.0,
            "layer_types": ["full_attention"] * hf["num_hidden_layers"],
            "num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 1,
            "moe_intermediate_size": 48, "norm_topk_prob": not hf.get("norm_topk_prob")}[key]


# the mapped keys whose change no longer fits the weights (refused by name); every other
# mapped key is compared, so a family whose keys were all refused could not pass unseen
_SIZES = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "intermediate_size", "head_dim"}
REFUSED = {**{family: _SIZES for family in FAMILIES},
           "qwen2": _SIZES | {"tie_word_embeddings"},  # tied: untying needs an lm_head
           "mixtral": _SIZES | {"num_local_experts"},
           # every layer sparse: intermediate_size is inert, the experts' width is not
           "qwen3_moe": _SIZES - {"intermediate_size"} | {"num_experts",
                                                        "moe_intermediate_size"}}


# the quick loop keeps a dense, a tied and a mixture-of-experts family
@pytest.mark.parametrize("family", [
    pytest.param(f, marks=() if f in ("llama", "qwen2", "mixtral") else pytest.mark.slow)
    for f in sorted(FAMILIES)])
def test_each_mapped_key_changes_the_logits_or_is_refused(tmp_path, family):
    hf = tiny_config(family)
    tensors = random_tensors(hf)
    before = zjax_logits(write_checkpoint(tmp_path / "base", hf, tensors))
    layout = layout_for_hf(hf, source="config.json")
    compared, refused = set(), set()
    for key in layout.mapped:
        changed = {**hf, key: _changed(key, hf)}
        try:
            after = zjax_logits(write_checkpoint(tmp_path / key, changed, tensors))
        except CheckpointError:
            refused.add(key)  # the weights no longer fit: refused by name
            continue
        assert np.abs(after - before).max() > 1e-3, f"{family}: {key} changed nothing"
        compared.add(key)
    assert refused == REFUSED[family], (family, sorted(refused))
    assert compared == set(layout.mapped) - REFUSED[family] and compared, family


def test_an_unknown_architecture_and_quantized_weights_are_refused(tmp_path):
    hf = {**tiny_config("llama"), "model_type": "falcon", "architectures": ["FalconForCausalLM"]}
    with pytest.raises(CheckpointError, match=r"model_type 'falcon' .* not supported; zjax "
                                              r"reads llama \(LlamaForCausalLM\), mistral"):
        layout_for_hf(hf, source="config.json")
    hf = {**tiny_config("qwen2"), "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(CheckpointError, match=r"quantization_config = .* quantized weights"):
        layout_for_hf(hf, source="c").from_hf(hf, source="c")
    hf = {**tiny_config("qwen2"), "use_sliding_window": True}
    with pytest.raises(CheckpointError, match=r"use_sliding_window = True is not supported"):
        layout_for_hf(hf, source="c").from_hf(hf, source="c")


def _finetune(tmp_path, directory, name: str, model_axis: int):
    out = import_hf(directory, tmp_path / f"imported-{name}")
    config = load_config(out / "zjax.yaml", [
        "train.steps=3", "zero.stage=3", f"mesh.model={model_axis}", "data.seq_len=32",
        "data.batch_size=8", "train.eval_every=0", "train.log_every=1",
        "logging.progress=false", "zero.gather_dtype=float32", "zero.reduce_dtype=float32"])
    return config, zjax.train(None, config, run_dir=tmp_path / f"run-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "mistral", "mixtral", "phi3",
                                    "qwen2", "qwen3", "qwen3_moe"])
def test_import_stage3_steps_export_reload_gives_the_trained_logits(tmp_path, family):
    """import-hf -> 3 stage-3 steps (tensor-parallel over 2 devices, the same losses as over
    1) -> export --format hf: the files hold the trained model (by the reference's forward
    too) under the original's architecture."""
    hf = tiny_config(family)
    tensors = random_tensors(hf)
    directory = write_checkpoint(tmp_path / "hf", hf, tensors)
    config, result = _finetune(tmp_path, directory, "tp", 2)
    _, single = _finetune(tmp_path, directory, "one", 1)
    np.testing.assert_allclose([r["loss"] for r in result.history],
                               [r["loss"] for r in single.history], rtol=1e-5)  # fp32 sums
    assert_replicas_identical(result.state, what="state")
    cls = model_class(config.model)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(config.model, rngs=nnx.Rngs(0))))
    tuned = np.asarray(nnx.merge(graphdef, jax.device_get(result.state.params))(TOKENS))
    assert np.abs(tuned - logits(hf, tensors, TOKENS)).max() > 1e-3  # it did train

    exported = export(tmp_path / "run-tp", tmp_path / "out", dtype="float32", format="hf")
    written = json.loads((exported / "config.json").read_text())
    assert written["architectures"] == hf["architectures"] and written == {
        **hf, "torch_dtype": "float32"} | {k: written[k] for k in ("dtype",) if k in written}
    np.testing.assert_allclose(zjax_logits(exported), tuned, atol=1e-5, rtol=0)
    files = SafetensorsDir(exported)
    assert sorted(files.names()) == sorted(tensors)
    np.testing.assert_allclose(
        logits(written, {n: files.array(n) for n in files.names()}, TOKENS), tuned,
        atol=ATOL, rtol=0)
