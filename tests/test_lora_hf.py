"""LoRA over an imported Hugging Face Llama: the base read from ``train.init_from``, the
adapters trained, ``--format hf`` merging them into the base (``W + alpha/r * B @ A``) into
what transformers loads, with the logits of zjax's adapted model."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from hf_models import hf_logits, hf_model, write_hf
from safetensors.numpy import load_file

import zjax
from zjax.config import load_config
from zjax.export import export
from zjax.hf import HFCheckpoint
from zjax.models import Llama

TOKENS = np.array([[1, 5, 9, 200, 13, 7, 42, 3]], np.int32)
MODEL = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=3", "model.n_heads=4",
         "model.n_kv_heads=2", "model.d_ff=80", "model.max_seq_len=64", "model.norm_eps=1e-5"]


@pytest.fixture(scope="module")
def lora_hf_run(tmp_path_factory):
    """A tiny random Hugging Face Llama, and a 3-step LoRA run (rank 4, alpha 8, attention
    and MLP projections) that started from it."""
    tmp = tmp_path_factory.mktemp("lora_hf")
    directory = write_hf(tmp / "hf", hf_model())
    config = load_config(None, [
        "loop=llama", f"train.init_from={directory}", *MODEL, "data.seq_len=32",
        "data.batch_size=8", "data.path=", "train.steps=3", "train.eval_every=0",
        "logging.progress=false", "optimizer.warmup_steps=0", "optimizer.lr=0.01",
        "lora.rank=4", "lora.alpha=8", "checkpoint.every=3"])
    result = zjax.train(None, config, run_dir=tmp / "run")
    return directory, config, result, tmp / "run"


def test_the_base_is_read_from_the_import_and_never_changes(lora_hf_run):
    directory, _, result, _ = lora_hf_run
    base = dict(HFCheckpoint(directory).host_leaves())
    frozen = jax.device_get(result.state.frozen)
    wq = frozen["blocks"]["layers"]["wq"]
    assert wq.dtype == np.dtype("bfloat16")  # lora.base_dtype
    np.testing.assert_array_equal(np.asarray(wq, np.float32),
                                  base[("blocks", "layers", "wq")].astype("bfloat16")
                                  .astype(np.float32))


def test_the_merged_export_is_base_plus_update_and_transformers_has_zjax_logits(
        lora_hf_run, tmp_path):
    from transformers import FlaxLlamaForCausalLM

    directory, config, result, run = lora_hf_run
    out = export(run, tmp_path / "merged", dtype="float32", format="hf")
    adapters = jax.device_get(result.state.params)["blocks"]["layers"]
    merged, original = load_file(out / "model.safetensors"), load_file(
        directory / "model.safetensors")
    scale = config.lora.alpha / config.lora.rank
    for i in range(3):
        name = f"model.layers.{i}.self_attn.q_proj.weight"
        update = (adapters["wq_lora_a"][i] @ adapters["wq_lora_b"][i]).T  # [out, in]
        assert np.abs(update).max() > 0  # the adapters trained
        np.testing.assert_allclose(merged[name], original[name] + scale * update,
                                   rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(merged["model.norm.weight"], original["model.norm.weight"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    # zjax's adapted model (float32 base from the files, the trained adapters) and
    # transformers' model of the merged files: the same function
    full = {**{"/".join(k): v for k, v in HFCheckpoint(directory).host_leaves()},
            **{f"blocks/layers/{k}": v for k, v in adapters.items()}}
    tree: dict = {}
    for path, v in full.items():
        *head, last = path.split("/")
        node = tree
        for k in head:
            node = node.setdefault(k, {})
        node[last] = np.asarray(v, np.float32)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(config.model, rngs=nnx.Rngs(0),
                                                         lora=config.lora)))
    ours = np.asarray(nnx.merge(graphdef, tree)(TOKENS))
    theirs = hf_logits(FlaxLlamaForCausalLM.from_pretrained(out), TOKENS)
    np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=0)


def test_sampling_the_run_the_merged_export_and_the_base_with_the_adapter_agree(
        lora_hf_run, tmp_path):
    """Greedy, token for token: ``zjax sample RUN`` (the base read again, the checkpoint's
    adapters), ``zjax sample MERGED`` and ``zjax sample BASE --adapter PEFT``."""
    from zjax.export import generate, load_sampler

    directory, _, _, run = lora_hf_run
    merged = export(run, tmp_path / "merged", dtype="float32", format="hf")
    peft = export(run, tmp_path / "peft", dtype="float32", format="peft")
    prompt = np.array([[1, 5, 9, 200, 13], [7, 42, 3, 3, 100]], np.int32)
    rows = [generate(load_sampler(src, adapter=a).model, prompt, max_new_tokens=12,
                     temperature=0.0, key=jax.random.key(0))
            for src, a in ((run, None), (merged, None), (directory, peft))]
    base = generate(load_sampler(directory).model, prompt, max_new_tokens=12,
                    temperature=0.0, key=jax.random.key(0))
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], rows[2])
    assert (rows[0] != base).any()  # the adapters change what is sampled


def test_init_adapter_continues_a_peft_adapter_and_refuses_another_shape(lora_hf_run,
                                                                        tmp_path):
    """``lora.init_adapter``: the run starts from the PEFT export's adapters (the first run's
    last ones) over the same base; another rank, or no base, is refused by key."""
    from zjax.task import build_step
    from zjax.training._initial import initial_state

    _, config, result, run = lora_hf_run
    peft = export(run, tmp_path / "peft", dtype="float32", format="peft")
    again = dataclasses.replace(config, lora=dataclasses.replace(config.lora,
                                                                 init_adapter=str(peft)))
    zstep = build_step(again)
    state = initial_state(zstep, again, lambda *a: None)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
                 jax.device_get(result.state.params))
    other = dataclasses.replace(again, lora=dataclasses.replace(again.lora, rank=8))
    with pytest.raises(zjax.ConfigError, match=r"^lora.rank: 8, but the adapter in "
                                               r"lora.init_adapter .* has 4$"):
        initial_state(build_step(other), other, lambda *a: None)
    alone = dataclasses.replace(again, train=dataclasses.replace(again.train, init_from=None))
    with pytest.raises(zjax.ConfigError, match=r"^lora.init_adapter: .* train.init_from"):
        build_step(alone)


def test_a_resume_over_another_base_is_refused(lora_hf_run, tmp_path):
    """The checkpoints record the base's digests: a resume whose train.init_from now holds
    other weights stops with an error naming the key, before any step."""
    import shutil

    directory, config, _, run = lora_hf_run
    copy, moved = tmp_path / "run", tmp_path / "hf"
    shutil.copytree(run, copy)
    other = write_hf(moved, hf_model(seed=1))
    again = dataclasses.replace(config, train=dataclasses.replace(
        config.train, init_from=str(other), steps=4))
    with pytest.raises(zjax.CheckpointError, match=r"^train.init_from: .* is not the base the "
                                                   r"checkpoint's adapters were trained over"):
        zjax.train(None, again, run_dir=copy)
    same = dataclasses.replace(again, train=dataclasses.replace(again.train,
                                                                init_from=str(directory)))
    assert [row["step"] for row in zjax.train(None, same, run_dir=copy).history][-1] == 4
