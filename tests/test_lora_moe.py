"""LoRA on a mixture of experts: adapters on the attention and on every expert's gate, up and
down projections (``[E, in, r]`` and ``[E, r, out]``, merged into the experts' weights before
their grouped matmuls), trained as single-device optax trains them, over an nf4 base too, and
written in PEFT's layout (one pair per layer and expert, under Mixtral's
``block_sparse_moe.experts.{e}``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    assert_matches_reference,
    flat_paths,
    make_tx,
    nested_paths,
    reference_run,
    train_steps,
)
from models import TINY_LLAMA, token_batches

import zjax
from zjax.lora import LINEAR_NAMES, LoraConfig, is_adapter
from zjax.models import Llama, lm_loss

MOE = dataclasses.replace(TINY_LLAMA, n_experts=4, experts_per_token=2, moe_d_ff=16)
LORA = LoraConfig(rank=4, alpha=8.0)
F32 = dict(prefetch_layers=1, param_persistence_threshold=0, gather_dtype="float32",
           reduce_dtype="float32")


def _trainable() -> zjax.Trainable:
    t = zjax.from_nnx(lambda rngs: Llama(MOE, rngs=rngs, lora=LORA), lm_loss)
    return dataclasses.replace(t, frozen=lambda path: not is_adapter(path))




@pytest.mark.parametrize(("data", "expert"), [
    pytest.param(8, 1, marks=pytest.mark.slow),
    pytest.param(4, 2, marks=pytest.mark.slow),  # the adapters split with their experts
])
def test_expert_adapters_train_as_single_device_optax(data, expert):
    batches = token_batches(3)
    full = _trainable().init(jax.random.key(0))
    layers = full["blocks"]["layers"]
    assert layers["w_gate_lora_a"].shape == (3, 4, 32, 4)  # [L, E, D, r]
    assert layers["w_down_lora_b"].shape == (3, 4, 4, 32)  # [L, E, r, D]
    base = {k: v for k, v in flat_paths(full).items() if not is_adapter(k)}
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(MOE, rngs=nnx.Rngs(0), lora=LORA)))

    def loss(params, batch):
        merged = {**base, **{k: v for k, v in flat_paths(params).items() if is_adapter(k)}}
        return lm_loss(nnx.merge(graphdef, nested_paths(merged)), batch)[:2]

    init = lambda rng: nested_paths({k: v for k, v in flat_paths(_trainable().init(rng)).items()
                              if is_adapter(k)})
    expected = reference_run(init, loss, make_tx(), batches)
    mesh = zjax.make_mesh(zjax.MeshConfig(data=data, expert=expert))
    _, state, losses = train_steps(_trainable(), zjax.ZeroConfig(stage=3, **F32), batches,
                                   mesh=mesh)
    assert_matches_reference(losses, state, expected)
    moved = np.asarray(state.params["blocks"]["layers"]["w_up_lora_b"])
    assert np.abs(moved).max() > 0  # the experts' adapters trained


@pytest.mark.slow
def test_expert_adapters_export_as_mixtral_s_peft_modules(tmp_path):
    """A 2-step run of a Mixtral-shaped model: ``experts.{e}.w1`` / ``w3`` / ``w2`` pairs for
    each layer and expert in the PEFT file, read back as the run's adapters; dropout on
    merged expert adapters is refused by key."""
    from safetensors.numpy import load_file

    from zjax.export import export
    from zjax.hf import layout_for_model, read_peft

    config = zjax.load_config("configs/llama-tiny.yaml", [
        "model.n_layers=2", "model.n_experts=4", "model.experts_per_token=2",
        "model.router_renormalize=true", "data.seq_len=32",
        "data.batch_size=8", "data.path=", "train.steps=2", "train.eval_every=0",
        "logging.progress=false", "lora.rank=4", "lora.alpha=8", "optimizer.lr=0.01",
        "optimizer.warmup_steps=0"])
    result = zjax.train(None, config, run_dir=tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "adapter", dtype="float32", format="peft")
    layout = layout_for_model("llama", config.model)
    tensors = load_file(out / "adapter_model.safetensors")
    meta = json.loads((out / "adapter_config.json").read_text())
    experts = [n for n in tensors if ".experts." in n]
    assert len(experts) == 2 * 4 * 3 * 2  # layers x experts x projections x (A, B)
    name = next(n for n in experts if n.endswith("experts.3.w2.lora_A.weight"))
    assert tensors[name].shape == (4, config.model.d_ff)  # down: [r, the experts' width]
    assert {"w1", "w2", "w3", "q_proj"} <= set(meta["target_modules"])
    lora, adapters = read_peft(out, layout, config.model)
    # every linear module of a (multi-head attention) Llama: the adapter targets all of them
    assert set(lora.targets_in(tuple(Llama.LORA_MODULES))) == set(LINEAR_NAMES)
    layers = jax.device_get(result.state.params)["blocks"]["layers"]
    for keys, value in adapters.items():
        np.testing.assert_array_equal(value, np.asarray(layers[keys[-1]], np.float32))
    assert len(adapters) == len(layers)
    dropped = dataclasses.replace(config, lora=dataclasses.replace(config.lora, dropout=0.1))
    with pytest.raises(zjax.ConfigError, match=r"^lora.dropout: 0.1 on a mixture's experts"):
        zjax.build_step(dropped)


@pytest.mark.parametrize("base_dtype", [  # the quick loop: bfloat16 (nf4: test_qlora)
    "bfloat16", pytest.param("nf4", marks=pytest.mark.slow)])
def test_the_adapted_mixture_is_the_plain_mixture_of_merged_weights(base_dtype):
    """Random ``b`` factors: the adapted model's logits equal those of the model without
    adapters whose every targeted weight (attention and experts) is ``W + alpha/r * A @ B``,
    merged in NumPy (float32); over an nf4 base (QLoRA of a mixture: the experts' ``[E, in,
    out]`` weights stored NormalFloat4 like the attention's), ``W`` dequantized."""
    from zjax.lora import dequantize

    moe = dataclasses.replace(MOE, d_model=64, moe_d_ff=64)  # inputs: whole nf4 blocks
    lora = dataclasses.replace(LORA, base_dtype=base_dtype)
    params = jax.device_get(nnx.to_pure_dict(nnx.state(
        Llama(moe, rngs=nnx.Rngs(0), lora=lora), nnx.Param)))
    layers = dict(params["blocks"]["layers"])
    if lora.quantized:
        assert layers["w_gate"].dtype == np.uint8 and layers["w_gate"].shape[:2] == (3, 4)
    rng = np.random.default_rng(0)
    merged = {k: v for k, v in layers.items() if not is_adapter(k)}  # norms: nested dicts
    for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        layers[f"{w}_lora_b"] = rng.normal(0, 0.05, layers[f"{w}_lora_b"].shape).astype(
            np.float32)
        base = np.asarray(dequantize(jnp.asarray(layers[w]), "nf4", 64, jnp.float32)) \
            if lora.quantized else layers[w]
        merged[w] = base + 2.0 * np.matmul(layers[f"{w}_lora_a"], layers[f"{w}_lora_b"])
    tokens = np.asarray(token_batches(1)[0][:2, :-1])
    adapted = nnx.merge(nnx.graphdef(nnx.eval_shape(
        lambda: Llama(moe, rngs=nnx.Rngs(0), lora=lora))),
        jax.tree.map(jnp.asarray, {**params, "blocks": {"layers": layers}}))
    plain = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Llama(moe, rngs=nnx.Rngs(0)))),
                      jax.tree.map(jnp.asarray, {**params, "blocks": {"layers": merged}}))
    np.testing.assert_allclose(np.asarray(adapted(tokens)), np.asarray(plain(tokens)),
                               rtol=1e-4, atol=1e-4)
