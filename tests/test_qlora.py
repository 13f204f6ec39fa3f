"""QLoRA: the frozen base's linear weights stored as int8 or NormalFloat4 (blocks of 64
inputs, one float32 absmax each), gathered in those bytes and dequantized in the block."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_on
from hf_models import hf_model, write_hf

import zjax
from zjax.config import load_config
from zjax.hf import HFCheckpoint
from zjax.lora import LoraConfig, dequantize, quantize
from zjax.lora._quant import NF4, packed_rows
from zjax.planning import collective_bytes
from zjax.runtime.targets import target


def test_int8_and_nf4_round_trips():
    """int8: within half a step (absmax/254) of each weight; nf4: each weight becomes the
    NF4 value nearest to it over its block's absmax, and NF4's values come back exactly."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (3, 128, 40)).astype(np.float32)
    absmax = np.abs(w.reshape(3, 2, 64, 40)).max(axis=2, keepdims=True)
    for kind in ("int8", "nf4"):
        packed = quantize(jnp.asarray(w), kind)
        assert packed.dtype == jnp.uint8 and packed.shape == (3, packed_rows(128, kind), 40)
        got = np.asarray(dequantize(packed, kind, 128, jnp.float32)).reshape(3, 2, 64, 40)
        if kind == "int8":
            assert np.all(np.abs(got - w.reshape(3, 2, 64, 40)) <= absmax / 254 * 1.0001)
        else:
            table = np.asarray(NF4, np.float32)
            scaled = w.reshape(3, 2, 64, 40) / absmax
            nearest = table[np.abs(scaled[..., None] - table).argmin(-1)] * absmax
            np.testing.assert_allclose(got, nearest, rtol=1e-6)
    exact = np.tile(np.asarray(NF4, np.float32), 8).reshape(128, 1) * 0.25
    np.testing.assert_array_equal(
        np.asarray(dequantize(quantize(jnp.asarray(exact), "nf4"), "nf4", 128, jnp.float32)),
        exact)
    with pytest.raises(zjax.ConfigError, match=r"^lora.base_dtype: .* 80 inputs, not a "
                                               r"multiple of the quantization block \(64\)"):
        quantize(jnp.zeros((80, 64)), "nf4")


WIDE = ["model.d_model=512", "model.d_ff=2048", "model.n_layers=2", "model.vocab_size=64",
        "data.seq_len=64", "data.batch_size=8", "data.path=", "lora.rank=4",
        "zero.param_persistence_threshold=0"]


@pytest.mark.parametrize("name", ["cpu", pytest.param("h100:8", marks=pytest.mark.slow)])
def test_an_nf4_base_gathers_under_0_30_of_a_bfloat16_one(name):
    """The compiled ZeRO-3 step's all-gather bytes: the base's linear weights move as codes
    and scales (0.5625 bytes a weight against 2); embeddings, norms and the adapters move in
    bfloat16 in both (here 3% of the bytes)."""
    where = None if name == "cpu" else target(name)
    moved = {}
    for base in ("bfloat16", "nf4"):
        config = zjax.load_config("configs/llama-tiny.yaml", [*WIDE, f"lora.base_dtype={base}"])
        zstep = zjax.build_step(config, where)
        compiled = compile_on(zstep.lower(zjax.abstract_batch(config)),
                              None if where is None else where.devices)
        moved[base] = collective_bytes(compiled.as_text()).all_gather
    assert moved["nf4"] <= 0.30 * moved["bfloat16"], moved


MODEL = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=3", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=128", "model.max_seq_len=64", "model.norm_eps=1e-5"]


@pytest.mark.slow
def test_a_qlora_run_starts_at_its_dequantized_base_and_trains(tmp_path):
    """nf4 over an imported Llama: step 0 equals the bfloat16 LoRA model whose linear weights
    are the nf4 ones dequantized (bit for bit: the same bfloat16 weights reach the
    matmuls); the base stays uint8 codes and trains nothing; the loss falls."""
    directory = write_hf(tmp_path / "hf", hf_model(intermediate_size=128))
    config = load_config(None, [
        "loop=llama", f"train.init_from={directory}", *MODEL, "data.seq_len=32",
        "data.batch_size=8", "data.path=", "train.steps=4", "train.eval_every=0",
        "logging.progress=false", "optimizer.warmup_steps=0", "optimizer.lr=0.01",
        "train.log_every=1", "lora.rank=4", "lora.base_dtype=nf4"])
    bf16 = dataclasses.replace(config, lora=LoraConfig(rank=4))
    quantized, plain = zjax.build_step(config), zjax.build_step(bf16)
    base = dict(HFCheckpoint(directory).host_leaves())
    linear = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    rounded = {k: np.asarray(dequantize(quantize(jnp.asarray(v), "nf4"), "nf4", v.shape[1],
                                        jnp.float32)) if k[-1] in linear else v
               for k, v in base.items()}

    def tree(flat):
        out: dict = {}
        for keys, v in flat.items():
            node = out
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = v
        return out

    place = lambda flat, zstep: jax.device_put(tree(flat), jax.tree.map(
        lambda a: a.sharding, zstep.base_target))
    s_q = quantized.from_base(place(base, quantized), jax.random.key(0))
    s_p = plain.from_base(place(rounded, plain), jax.random.key(0))
    batch = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    assert float(quantized.evaluate(s_q.params, quantized.put_batch(batch), s_q.frozen)) == \
        float(plain.evaluate(s_p.params, plain.put_batch(batch), s_p.frozen))
    result = zjax.train(None, config, run_dir=tmp_path / "run")
    frozen = jax.device_get(result.state.frozen)["blocks"]["layers"]
    assert frozen["wq"].dtype == np.uint8 and frozen["wq"].shape == (3, 36, 64)
    np.testing.assert_array_equal(frozen["w_down"], np.asarray(jax.device_get(
        s_q.frozen)["blocks"]["layers"]["w_down"]))
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < losses[0]
    # --format hf: the dequantized base plus the update; sampling the run agrees with it
    from zjax.export import export, generate, load_sampler

    out = export(tmp_path / "run", tmp_path / "merged", dtype="float32", format="hf")
    from safetensors.numpy import load_file

    merged = load_file(out / "model.safetensors")
    adapters = jax.device_get(result.state.params)["blocks"]["layers"]
    wq = rounded[("blocks", "layers", "wq")]
    for i in range(3):
        update = adapters["wq_lora_a"][i] @ adapters["wq_lora_b"][i]
        np.testing.assert_allclose(merged[f"model.layers.{i}.self_attn.q_proj.weight"],
                                   (wq[i] + config.lora.scale * update).T, rtol=1e-6,
                                   atol=1e-7)
    prompt = np.array([[1, 5, 9, 200, 13]], np.int32)
    tokens = [generate(load_sampler(src).model, prompt, max_new_tokens=8, temperature=0.0,
                       key=jax.random.key(0)) for src in (tmp_path / "run", out)]
    np.testing.assert_array_equal(tokens[0], tokens[1])


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides", "room"), [
    ("h100:8", [], 0.5),  # one 8192-token sequence per device, with room to spare
    ("h100:1", ["data.batch_size=1", "data.seq_len=4096"], 0.9),  # the moonshot
])
def test_qlora_of_llama3_70b_fits(name, overrides, room):
    """configs/qlora-llama3-70b.yaml (nf4, rank 16 on every linear layer): the compiled
    step's peak within ``room`` of the H100's memory, on eight and on one."""
    config = zjax.load_config("configs/qlora-llama3-70b.yaml", overrides)
    report = zjax.plan(config, target=name)
    assert report.n_params == 70_760_800_256 and report.frozen["trained_params"] == 207_093_760
    assert report.per_device["total_bytes"] <= room * report.per_device["capacity_bytes"]


@pytest.mark.slow
def test_the_budget_search_quantizes_the_base_only_where_allowed_and_needed():
    """``autotune(base_dtypes=...)`` on one device: a budget the bfloat16 base overflows takes
    the most precise allowed dtype that fits (int8 before nf4); without ``base_dtypes`` the
    config's own dtype is kept and nothing fits; a dtype is never chosen unless allowed."""
    from zjax.planning import autotune

    config = load_config("configs/llama-tiny.yaml", [
        "model.d_model=512", "model.d_ff=1024", "model.n_heads=8", "model.n_kv_heads=8",
        "model.n_layers=2", "model.vocab_size=256", "data.batch_size=1", "data.seq_len=32",
        "data.path=", "lora.rank=4"])
    space = dict(devices=1, stages=(3,), offloads=("none",), prefetch=(1,), grad_accum=(1,),
                 remat=(True,), activations=("device",), model=(1,))
    sizes = {d: zjax.plan(dataclasses.replace(config, lora=dataclasses.replace(
        config.lora, base_dtype=d)), devices=1).per_device["total_bytes"]
        for d in ("bfloat16", "int8", "nf4")}
    assert sizes["bfloat16"] > sizes["int8"] > sizes["nf4"]
    budget = (sizes["bfloat16"] + sizes["int8"]) // 2  # int8 fits, bfloat16 does not
    with pytest.raises(zjax.ConfigError, match=r"^--budget: .* fits no configuration"):
        autotune(config, budget=budget, **space)
    result = autotune(config, budget=budget, base_dtypes=["nf4", "int8", "bfloat16"], **space)
    assert result.config.lora.base_dtype == "int8"
    assert result.notes[0].startswith("lora.base_dtype bfloat16: ")
    assert "lora.base_dtype: int8" in result.table()
    assert autotune(config, budget=budget, base_dtypes=["nf4"],
                    **space).config.lora.base_dtype == "nf4"
    with pytest.raises(zjax.ConfigError, match=r"^--base-dtypes: 'fp4' is not a "
                                               r"lora.base_dtype"):
        autotune(config, budget=budget, base_dtypes=["fp4"], **space)
    with pytest.raises(zjax.ConfigError, match=r"^--budget: no allowed lora.base_dtype fits"):
        autotune(config, budget=sizes["nf4"] // 2, base_dtypes=["int8", "nf4"], **space)
