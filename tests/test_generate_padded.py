"""Prompts of different lengths decoded in one left-padded batch (``generate(...,
lengths=...)``, ``decode(..., pads=...)``) give each row what its prompt alone gives: the same
greedy tokens and the same prefill logits, for a Llama (also windowed, and a mixture of
experts) and a GPT."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models import TINY, TINY_LLAMA

import zjax
from zjax.generate import decode_tokens, generate
from zjax.models import GPT, Llama

LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=2)
CONFIGS = {
    "llama": (Llama, LLAMA),
    "llama_windowed": (Llama, dataclasses.replace(LLAMA, sliding_window=3, global_every=2)),
    "llama_moe": (Llama, dataclasses.replace(LLAMA, n_experts=4, experts_per_token=2,
                                             moe_d_ff=16)),
    "gpt": (GPT, dataclasses.replace(TINY, n_layers=2)),
    # DeepSeek's latent attention: decoding attends over the latent cache
    "llama_mla": (Llama, dataclasses.replace(LLAMA, n_kv_heads=None, kv_lora_rank=8,
                                             q_lora_rank=12, qk_nope_head_dim=4,
                                             qk_rope_head_dim=4, v_head_dim=6)),
}
LENGTHS = (3, 5, 8)
WIDTH, NEW = 8, 6
SCALE = 8.0


@pytest.fixture(scope="module", params=[  # the quick loop: < 10 s cold, the mixture's 4 s
    *(n for n in CONFIGS if n != "llama_moe"), pytest.param("llama_moe", marks=pytest.mark.slow)])
def model(request):
    """The model, its weight matrices scaled up: at the initial 0.02 spread attention is
    nearly uniform and barely moves the logits, so greedy tokens would hide a leak."""
    cls, cfg = CONFIGS[request.param]
    graphdef, state = nnx.split(cls(cfg, rngs=nnx.Rngs(0)))
    return nnx.merge(graphdef, jax.tree.map(lambda w: w * SCALE if w.ndim > 1 else w, state))


@pytest.fixture(scope="module")
def prompts():
    """The prompts alone, and left-padded to ``WIDTH`` (the padding random tokens too: what
    it holds must not matter)."""
    rng = np.random.default_rng(0)
    alone = [rng.integers(0, 64, (n,)) for n in LENGTHS]
    padded = rng.integers(0, 64, (len(LENGTHS), WIDTH))
    for row, tokens in zip(padded, alone, strict=True):
        row[WIDTH - len(tokens):] = tokens
    return alone, padded


def test_padded_generation_is_each_prompt_alone(model, prompts):
    alone, padded = prompts
    kw = dict(max_new_tokens=NEW, temperature=0, key=jax.random.key(0))
    together = generate(model, padded, lengths=LENGTHS, **kw)
    for row, tokens in zip(together, alone, strict=True):
        np.testing.assert_array_equal(row, generate(model, tokens[None], **kw)[0])


def test_padded_prefill_logits_are_each_prompt_alone(model, prompts):
    alone, padded = prompts
    pads = jnp.asarray([WIDTH - n for n in LENGTHS], jnp.int32)
    logits, _ = model.decode(jnp.asarray(padded), model.init_cache(len(LENGTHS), WIDTH), 0,
                             pads=pads)
    for row, tokens in zip(logits, alone, strict=True):
        single, _ = model.decode(jnp.asarray(tokens[None]), model.init_cache(1, len(tokens)), 0)
        assert np.isfinite(row).all()  # the padding queries see no key: no NaN either
        np.testing.assert_allclose(row[WIDTH - len(tokens):], single[0], atol=1e-5, rtol=0)


def test_decode_tokens_runs_inside_a_jit(prompts):
    cls, cfg = CONFIGS["gpt"]
    model = cls(cfg, rngs=nnx.Rngs(0))
    _, padded = prompts
    graphdef, params = nnx.split(model)
    pads = jnp.asarray([WIDTH - n for n in LENGTHS], jnp.int32)

    @jax.jit
    def rollout(params, prompt, pads):  # an RL rollout's caller: its own jit, a merged model
        return decode_tokens(nnx.merge(graphdef, params), prompt, pads, jax.random.key(0),
                             jnp.asarray([-1]), new=NEW, temperature=0.0, top_p=1.0)

    np.testing.assert_array_equal(
        rollout(params, jnp.asarray(padded), pads),
        generate(model, padded, lengths=LENGTHS, max_new_tokens=NEW, temperature=0,
                 key=jax.random.key(0)))


@pytest.mark.parametrize("lengths, match", [
    ((3, 5), r"^lengths: one length per prompt row \(3\) expected"),
    ((3, 0, 8), r"^lengths: each must be an integer in 1\.\.8"),
    ((3, 5, 9), r"^lengths: each must be an integer in 1\.\.8"),
])
def test_bad_lengths_are_refused(prompts, lengths, match):
    cls, cfg = CONFIGS["gpt"]
    with pytest.raises(zjax.ArgumentError, match=match):
        generate(cls(cfg, rngs=nnx.Rngs(0)), prompts[1], lengths=lengths, max_new_tokens=NEW,
                 key=jax.random.key(0))
