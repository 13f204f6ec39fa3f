"""``zjax sample``: decoding with the key/value cache gives the full forward's logits, greedy
generation gives transformers' tokens on the same weights, nucleus sampling draws only from
the nucleus, and the CLI samples a run and refuses bad input with exit 2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import zjax_main
from hf_models import hf_model, write_hf

import zjax
from zjax.export.sample import Sampler, generate, load_sampler, pick
from zjax.models import GPT, GPTConfig, Llama, LlamaConfig

MODELS = {
    "gpt": (GPT, GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                           tie_embeddings=False)),
    "llama": (Llama, LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                 n_kv_heads=2, d_ff=48, max_seq_len=32)),
}


@pytest.mark.parametrize("name", [  # the quick loop keeps the GPT's cache
    "gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_cached_decoding_gives_the_full_forward_logits(name):
    cls, cfg = MODELS[name]
    model = cls(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    cache = model.init_cache(2, 16)
    logits, cache = model.decode(tokens[:, :5], cache, 0)  # the prompt, then one at a time
    steps = [logits]
    for pos in range(5, 12):
        logits, cache = model.decode(tokens[:, pos:pos + 1], cache, pos)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), model(tokens), atol=1e-5, rtol=0)


@pytest.mark.slow  # quick loop: 12 s (it keeps the cached decoder's equality)
def test_greedy_generation_is_transformers(tmp_path):
    hf = hf_model()
    sampler = load_sampler(write_hf(tmp_path / "hf", hf))
    prompt = np.random.default_rng(3).integers(0, 256, (2, 7))
    ours = generate(sampler.model, prompt, max_new_tokens=12, temperature=0,
                    key=jax.random.key(0))
    theirs = np.asarray(hf.generate(prompt, max_new_tokens=12, do_sample=False,
                                    pad_token_id=0).sequences)[:, 7:]
    np.testing.assert_array_equal(ours, theirs)


def test_nucleus_draws_only_from_the_nucleus():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = jnp.log(jnp.asarray(np.tile(probs, (4000, 1)), jnp.float32))
    key = jax.random.key(0)
    drawn = np.asarray(pick(logits, key, temperature=1.0, top_p=0.6))
    assert set(drawn) == {0, 1}  # 0.4 < 0.6: the second token completes the nucleus
    np.testing.assert_allclose(np.mean(drawn == 0), 0.4 / 0.7, atol=0.03)
    everything = np.asarray(pick(logits, key, temperature=1.0, top_p=1.0))
    np.testing.assert_allclose(np.bincount(everything, minlength=4) / 4000, probs, atol=0.03)
    assert set(np.asarray(pick(logits, key, temperature=1.0, top_p=0.1))) == {0}
    assert set(np.asarray(pick(logits, key, temperature=0.0, top_p=1.0))) == {0}


def test_too_long_a_generation_is_refused():
    cls, cfg = MODELS["gpt"]
    with pytest.raises(zjax.ConfigError, match=r"--max-new-tokens: .*exceed the model's "
                       r"max_seq_len 32"):
        generate(cls(cfg, rngs=nnx.Rngs(0)), np.zeros((1, 30), int), max_new_tokens=3,
                 key=jax.random.key(0))


@pytest.mark.slow  # quick loop: 6 s (it keeps the cached decoder's equality)
def test_cli_samples_a_run_and_refuses_bad_input(tmp_path):
    run = tmp_path / "run"
    zjax.train("lm", {"train": {"steps": 2, "eval_every": 0}, "logging": {"progress": False},
                      "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
                      "data": {"seq_len": 16, "batch_size": 8}}, run_dir=run)
    r = zjax_main("sample", str(run), "--prompt", "def ", "--max-new-tokens", "8", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- sample") == 2 and "\ndef " in r.stdout
    for args, message in [(["--top-p", "0"], "--top-p: 0.0; expected a number in (0, 1]"),
                          (["--max-new-tokens", "300"], "exceed the model's max_seq_len")]:
        r = zjax_main("sample", str(run), "--prompt", "x", *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    r = zjax_main("sample", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "is not a run directory" in r.stderr


def test_sampler_refuses_a_seed_outside_32_bits_and_a_prompt_not_utf8():
    """The Python API's refusals (the CLI checks the same before it loads the model)."""
    cls, cfg = MODELS["gpt"]
    sampler = Sampler(cls(cfg, rngs=nnx.Rngs(0)), None, "test")
    for seed in (2**70, -2**70, 2**32, -1):  # past int64: OverflowError in jax.random.key
        with pytest.raises(zjax.ConfigError, match=rf"^--seed: {seed}; .*\[0, 4294967296\)"):
            sampler("a", max_new_tokens=1, seed=seed)
    with pytest.raises(zjax.ConfigError, match=r"^--prompt: not valid UTF-8 \(the byte 0xff "
                                               r"at character 3\)"):
        sampler.encode("caf\udcff")
    with pytest.raises(zjax.ConfigError, match=r"^--prompt: not valid UTF-8 \(the lone "
                                               r"surrogate U\+D800 at character 0\)"):
        sampler("\ud800", max_new_tokens=1)
    assert sampler.encode("café") == list("café".encode())
