"""Tiny random Hugging Face Llamas and GPT-2s written as the Hub has them (PyTorch-layout
safetensors), with nothing downloaded and no torch: transformers 4.57's
``FlaxLlamaForCausalLM`` / ``FlaxGPT2LMHeadModel`` make the weights, and :func:`pt_layout`
renames them by Hugging Face's own PyTorch <-> Flax rules
(``kernel`` [in, out] -> ``weight`` [out, in], ``embedding`` -> ``weight``, norms as they are).
``FlaxLlamaForCausalLM.from_pretrained`` reads such a file back through transformers' own
converter (tests/test_hf.py checks it does, with equal logits), so the files are what a Hub
checkpoint is, not zjax's idea of one."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
# rope_theta 10000: transformers' Flax Llama ignores the key and always uses 10000 (its
# PyTorch Llama and zjax's honour it; tests/test_llama.py checks zjax's rotary on its own)


def hf_model(seed: int = 0, **changes):
    """A float32 ``FlaxLlamaForCausalLM`` with random weights (norm weights random too, so a
    misplaced norm cannot hide behind all-ones)."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(**{**TINY_HF, **changes})
    model = FlaxLlamaForCausalLM(config, seed=seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)

    model.params = _jitter(model.params, rng)
    return model


def _jitter(params, rng):
    """Norm scales near 1 and biases near 0 but random: a misplaced one cannot hide behind
    the init's all-ones or all-zeros."""
    def one(path, x):
        name = jax.tree_util.keystr(path)
        noise = 0.1 * rng.standard_normal(x.shape).astype(np.float32)
        if "norm" in name or ("ln_" in name and "scale" in name):
            return 1 + noise
        return noise if "bias" in name else np.asarray(x)

    return jax.tree_util.tree_map_with_path(one, params)


def hf_gpt2(seed: int = 0, **changes):
    """A float32 ``FlaxGPT2LMHeadModel`` with random weights, norms and biases."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(**{**TINY_GPT2, **changes})
    model = FlaxGPT2LMHeadModel(config, seed=seed, dtype=jnp.float32)
    model.params = _jitter(model.params, np.random.default_rng(seed))
    return model


TINY_GPT2 = dict(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=64)


def pt_layout(flax_params: dict) -> dict[str, np.ndarray]:
    """Hugging Face Flax params -> PyTorch ``state_dict`` names and layouts (GPT-2's Flax
    ``Conv1D`` keeps its kernel ``[out, in]``, so the same transpose gives PyTorch's
    ``[in, out]``)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(flax_params)[0]:
        keys = [str(k.key) for k in path]
        x = np.asarray(x, np.float32)
        if keys[-1] == "kernel":
            x = x.T
        if keys[-1] in ("kernel", "embedding", "scale"):
            keys[-1] = "weight"
        out[".".join(keys)] = np.ascontiguousarray(x)
    return out


def write_hf(directory: Path, model, *, shards: int = 1, dtype=np.float32,
             strip: str = "") -> Path:
    """``config.json`` and PyTorch-layout safetensors of ``model`` (``shards`` files with an
    index when above 1), as ``save_pretrained`` of a PyTorch model writes them."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / "config.json")
    tensors = {k: v.astype(dtype) for k, v in pt_layout(model.params).items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if strip:  # as the original `gpt2` on the Hub, saved from GPT2Model
        tensors = {k.removeprefix(strip): v for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
         "weight_map": weight_map}))
    return directory


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(model(tokens).logits, np.float32)
