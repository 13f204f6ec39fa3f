"""LoRA on the GPT (GPT-2's modules: ``c_attn`` fused, ``c_proj``, ``c_fc``) and dropout on
the adapters' input.

The engine against single-device optax (FP32 tolerance, float32 gathers); dropout's masks
drawn per row of the global batch, so 8 sharded devices train as one does; an imported
GPT-2's adapters exported in PEFT's layout (``c_attn``'s ``lora_B`` ``[3D, r]``) and merged
into weights that transformers' GPT-2 runs with zjax's logits.
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
from hf_models import TINY_GPT2, hf_gpt2, hf_logits, write_hf
from models import TINY, token_batches

import zjax
from zjax.lora import AdapterDropout, LoraConfig, is_adapter
from zjax.models import GPT, lm_loss

LORA = LoraConfig(rank=4, alpha=8.0)
F32 = dict(param_persistence_threshold=0, gather_dtype="float32", reduce_dtype="float32")


def _trainable(lora: LoraConfig = LORA, *, seed: int | None = None) -> zjax.Trainable:
    """The tiny GPT with adapters on c_attn, c_proj and c_fc, its base frozen in float32."""
    t = zjax.from_nnx(lambda rngs: GPT(TINY, rngs=rngs, lora=lora), lm_loss)
    return dataclasses.replace(t, frozen=lambda path: not is_adapter(path), dropout_seed=seed)



def test_gpt_adapters_train_as_single_device_optax():
    """c_attn's one pair (``a`` ``[D, r]``, ``b`` ``[r, 3, D]``) and the others', stage 3 over
    8 devices, against optax on the adapters alone."""
    batches = token_batches(4)
    full = _trainable().init(jax.random.key(0))
    flat = flat_paths(full)
    base = {k: v for k, v in flat.items() if not is_adapter(k)}
    layers = full["blocks"]["layers"]
    assert layers["c_attn_lora_a"].shape == (3, 32, 4)
    assert layers["c_attn_lora_b"].shape == (3, 4, 3, 32)
    assert {k for k in layers if is_adapter(k)} == {
        f"{w}_lora_{f}" for w in ("c_attn", "wo", "w_up", "w_down") for f in "ab"}
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(TINY, rngs=nnx.Rngs(0), lora=LORA)))

    def loss(params, batch):
        merged = {**base, **{k: v for k, v in flat_paths(params).items() if is_adapter(k)}}
        return lm_loss(nnx.merge(graphdef, nested_paths(merged)), batch)

    init = lambda rng: nested_paths({k: v for k, v in flat_paths(_trainable().init(rng)).items()
                              if is_adapter(k)})
    expected = reference_run(init, loss, make_tx(), batches)
    zero = zjax.ZeroConfig(stage=3, prefetch_layers=1, **F32)
    _, state, losses = train_steps(_trainable(), zero, batches)
    assert_matches_reference(losses, state, expected)



def test_dropout_masks_are_a_row_s_own_and_keep_the_mean():
    keys = zjax.lora.row_keys(0, jnp.int32(3), 4)
    y = jnp.ones((4, 64, 256), jnp.float32)
    drop = AdapterDropout(0.25, keys, jnp.int32(1))
    out = np.asarray(drop(y, 0))
    assert set(np.unique(out)) == {0.0, np.float32(1 / 0.75)}
    assert abs((out == 0).mean() - 0.25) < 0.01
    # the same row key, layer and module draw the same mask; another of any, another mask
    np.testing.assert_array_equal(out[1:2], np.asarray(
        AdapterDropout(0.25, keys[1:2], jnp.int32(1))(y[1:2], 0)))
    for other in (drop(y, 1), AdapterDropout(0.25, keys, jnp.int32(2))(y, 0),
                  AdapterDropout(0.25, zjax.lora.row_keys(0, jnp.int32(4), 4), 1)(y, 0)):
        assert (np.asarray(other) != out).mean() > 0.2
    assert (out[0] != out[1]).mean() > 0.2


@pytest.mark.slow
def test_dropout_trains_alike_on_8_devices_and_on_one_and_leaves_evaluation_alone():
    """Masks follow the global row, not the device: stage 3 over 8 devices (2 micro-batches)
    and one device train the same losses; they are not the losses without dropout, and the
    evaluation (no dropout) of the starting state is the base model's."""
    batches = token_batches(3)
    lora = dataclasses.replace(LORA, dropout=0.3)
    zero = zjax.ZeroConfig(stage=3, prefetch_layers=1, **F32)
    one = zjax.make_mesh(zjax.MeshConfig(data=1), devices=jax.devices()[:1])
    z8, s8, sharded = train_steps(_trainable(lora, seed=5), zero, batches, micro_batches=2)
    _, s1, single = train_steps(_trainable(lora, seed=5), zjax.ZeroConfig(stage=0, **F32),
                                batches, mesh=one)
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
                 jax.device_get(s8.params), jax.device_get(s1.params))
    plain_step, _, plain = train_steps(_trainable(lora), zero, batches)  # no seed, no dropout
    # step 1 (B = 0) is the base model whatever the masks; later steps are not
    assert plain[0] == pytest.approx(sharded[0], rel=1e-6)
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain[1:], sharded[1:], strict=True))
    batch = z8.put_batch(batches[0])
    assert float(z8.evaluate(s8.params, batch, s8.frozen)) == pytest.approx(
        float(plain_step.evaluate(s8.params, batch, s8.frozen)), rel=1e-6)


MODEL = ["loop=lm", "model.vocab_size=256", "model.d_model=64", "model.n_layers=3",
         "model.n_heads=4", "model.d_ff=256", "model.max_seq_len=64", "model.norm=layer",
         "model.bias=true", "model.tie_embeddings=true", "model.norm_eps=1e-5"]


@pytest.fixture(scope="module")
def gpt2_lora_run(tmp_path_factory):
    """A tiny random GPT-2 and a 3-step LoRA run over it (rank 4, alpha 8, all-linear,
    dropout 0.1)."""
    assert TINY_GPT2["n_embd"] == 64
    tmp = tmp_path_factory.mktemp("lora_gpt2")
    directory = write_hf(tmp / "hf", hf_gpt2())
    config = zjax.load_config(None, [
        *MODEL, f"train.init_from={directory}", "data.seq_len=32", "data.batch_size=8",
        "data.path=", "train.steps=3", "train.eval_every=0", "logging.progress=false",
        "optimizer.warmup_steps=0", "optimizer.lr=0.01", "lora.rank=4", "lora.alpha=8",
        "lora.dropout=0.1", "checkpoint.every=3"])
    result = zjax.train(None, config, run_dir=tmp / "run")
    return directory, config, result, tmp / "run"


@pytest.mark.slow
def test_gpt2_adapters_export_in_peft_s_layout_and_read_back(gpt2_lora_run, tmp_path):
    from safetensors.numpy import load_file

    from zjax.export import export
    from zjax.hf import layout_for_model, read_peft

    _, config, result, run = gpt2_lora_run
    out = export(run, tmp_path / "adapter", dtype="float32", format="peft")
    meta = json.loads((out / "adapter_config.json").read_text())
    assert meta["target_modules"] == ["c_attn", "c_fc", "c_proj"]
    assert meta["fan_in_fan_out"] is True and meta["lora_dropout"] == 0.1
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 3 * 4 * 2
    h = "base_model.model.transformer.h.{i}."
    shapes = {"attn.c_attn": (4, 64, 192), "attn.c_proj": (4, 64, 64),
              "mlp.c_fc": (4, 64, 256), "mlp.c_proj": (4, 256, 64)}
    for module, (r, d_in, d_out) in shapes.items():
        for i in range(3):
            name = h.format(i=i) + module
            assert tensors[f"{name}.lora_A.weight"].shape == (r, d_in), name
            assert tensors[f"{name}.lora_B.weight"].shape == (d_out, r), name
    layers = jax.device_get(result.state.params)["blocks"]["layers"]
    b = np.asarray(layers["c_attn_lora_b"][2], np.float32)  # [r, 3 (q, k, v), D]
    np.testing.assert_array_equal(tensors[h.format(i=2) + "attn.c_attn.lora_B.weight"],
                                  np.concatenate([b[:, 0], b[:, 1], b[:, 2]], axis=1).T)
    assert np.abs(b[:, 1]).max() > 0  # trained away from zeros (the keys' part too)
    lora, adapters = read_peft(out, layout_for_model("lm", config.model), config.model)
    assert (lora.rank, lora.alpha, sorted(lora.targets)) == (4, 8.0, ["c_attn", "c_fc",
                                                                       "c_proj"])
    for keys, value in adapters.items():
        np.testing.assert_array_equal(value, np.asarray(layers[keys[-1]], np.float32))
    assert len(adapters) == 8


@pytest.mark.slow
def test_gpt2_merged_export_is_base_plus_update_with_zjax_s_logits(gpt2_lora_run, tmp_path):
    from transformers import FlaxGPT2LMHeadModel

    from zjax.export import export
    from zjax.hf import HFCheckpoint

    directory, config, result, run = gpt2_lora_run
    out = export(run, tmp_path / "merged", dtype="float32", format="hf")
    base = dict(HFCheckpoint(directory).host_leaves())
    merged = dict(HFCheckpoint(out).host_leaves())
    layers = jax.device_get(result.state.params)["blocks"]["layers"]
    a = np.asarray(layers["c_attn_lora_a"], np.float32)
    b = np.asarray(layers["c_attn_lora_b"], np.float32)
    for part, w in enumerate(("wq", "wk", "wv")):
        keys = ("blocks", "layers", w)
        np.testing.assert_allclose(merged[keys], base[keys] + 2.0 * a @ b[:, :, part],
                                   rtol=1e-6, atol=1e-6)
    tree: dict = {}  # zjax's adapted model: the float32 base from the files, the adapters
    for keys, v in [*base.items(), *((("blocks", "layers", k), v) for k, v in layers.items())]:
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = np.asarray(v, np.float32)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(config.model, rngs=nnx.Rngs(0),
                                                       lora=config.lora)))
    tokens = np.array([[1, 5, 9, 200, 13, 7, 42, 3]], np.int32)
    ours = np.asarray(nnx.merge(graphdef, tree)(jnp.asarray(tokens)))
    theirs = hf_logits(FlaxGPT2LMHeadModel.from_pretrained(out, dtype=jnp.float32), tokens)
    np.testing.assert_allclose(ours, theirs, atol=2e-4)
    # greedy samples: the run (base read again), the merged export, the base + PEFT adapter
    from zjax.export import generate, load_sampler

    peft = export(run, tmp_path / "peft", dtype="float32", format="peft")
    rows = [generate(load_sampler(src, adapter=a).model, tokens[:, :5], max_new_tokens=8,
                     temperature=0.0, key=jax.random.key(0))
            for src, a in ((run, None), (out, None), (directory, peft))]
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], rows[2])
