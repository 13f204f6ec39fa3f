"""The reference Llama: its forward against an independent numpy implementation, ZeRO and
tensor-parallel training against single-device optax, config errors, the CLI template."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, assert_matches_reference, make_tx, reference_run, train_steps
from models import TINY_LLAMA, llama_reference_loss, llama_trainable, token_batches

import zjax
from zjax.config import load_config
from zjax.models import LlamaConfig
from zjax.models.llama import rotary


def _np_rotary(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding as a complex rotation of the pairs (x_i, x_{i + hd/2})."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-np.arange(0, hd, 2) / hd)
    z = x[..., :hd // 2] + 1j * x[..., hd // 2:]
    z = z * np.exp(1j * np.arange(t)[None, :, None, None] * inv_freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def _np_llama(params: dict, tokens: np.ndarray, cfg: LlamaConfig) -> np.ndarray:
    """Float64 logits of a Llama, written out op by op (key/value heads repeated)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    norm = lambda x, s: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * s
    b, t = tokens.shape
    hd, g = cfg.head_width, cfg.n_heads // cfg.kv_heads
    x = p["embed"][tokens]
    layers = p["blocks"]["layers"]
    for i in range(cfg.n_layers):
        w = jax.tree.map(lambda a, i=i: a[i], layers)
        y = norm(x, w["ln1"]["scale"])
        q = _np_rotary((y @ w["wq"]).reshape(b, t, cfg.n_heads, hd), cfg.rope_theta)
        k = _np_rotary((y @ w["wk"]).reshape(b, t, cfg.kv_heads, hd), cfg.rope_theta)
        v = (y @ w["wv"]).reshape(b, t, cfg.kv_heads, hd)
        k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head j reads j // g
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, -1) @ w["wo"]
        y = norm(x, w["ln2"]["scale"])
        gate = y @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (y @ w["w_up"])) @ w["w_down"]
    return norm(x, p["ln_f"]["scale"]) @ p["head"]


def _np_llama3(inv_freq: np.ndarray, factor, low, high, old_len) -> np.ndarray:
    """transformers' ``_compute_llama3_parameters`` (4.57), written again in numpy."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * np.pi / inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out)


def test_llama3_rope_scaling_is_huggingfaces():
    """Llama 3.1's scaling at head_dim 128, theta 500000: long wavelengths divided by 8, short
    ones kept, the band between blended; and rotary() rotates by the scaled frequencies."""
    from zjax.models.llama import llama3_frequencies

    hd, theta, scaling = 128, 500000.0, (8.0, 1.0, 4.0, 8192)
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    want = _np_llama3(inv, *scaling)
    got = np.asarray(llama3_frequencies(jnp.asarray(inv, jnp.float32), *scaling))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    ratio = want / inv
    assert ratio[0] == 1 and ratio[-1] == 1 / 8 and ((ratio > 1 / 8) & (ratio < 1)).any()
    x = np.random.default_rng(0).normal(size=(1, 40, 2, hd)).astype(np.float32)
    angles = np.arange(40)[None, :, None, None] * want
    z = (x[..., :hd // 2] + 1j * x[..., hd // 2:]) * np.exp(1j * angles)
    np.testing.assert_allclose(np.asarray(rotary(jnp.asarray(x), theta, 0, scaling)),
                               np.concatenate([z.real, z.imag], axis=-1), atol=2e-4)
    cfg = LlamaConfig(d_model=256, n_heads=2, rope_theta=theta, rope_scaling="llama3")
    assert cfg.rope == (theta, scaling)
    with pytest.raises(zjax.ConfigError, match=r"model.rope_scaling: 'dynamic' is not "
                       r"supported; choose llama3 .*, linear, yarn, longrope"):
        LlamaConfig(rope_scaling="dynamic")
    with pytest.raises(zjax.ConfigError, match=r"model.rope_short_factor: expected 64 "):
        LlamaConfig(d_model=256, n_heads=2, rope_scaling="longrope",
                    rope_short_factor=[1.0] * 3, rope_long_factor=[1.0] * 64)


def test_linear_rope_scaling_divides_every_frequency_and_windows_need_a_window():
    """Linear scaling (Gemma 3's global layers) is rotary at position / factor; the local
    layers' own base is unscaled; the layer pattern keys are refused without a window."""
    x = np.random.default_rng(0).normal(size=(1, 9, 2, 8)).astype(np.float32)
    cfg = LlamaConfig(d_model=16, n_heads=2, rope_theta=100.0, rope_scaling="linear",
                      rope_factor=4.0, sliding_window=3, global_every=2, local_rope_theta=7.0)
    theta, scaling = cfg.rope
    got = np.asarray(rotary(jnp.asarray(x), theta, 0, scaling))
    inv = 100.0 ** (-np.arange(0, 8, 2) / 8) / 4.0
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * np.arange(9)[None, :, None, None] * inv)
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], axis=-1), atol=1e-5)
    assert cfg.local_rope == (7.0, None)
    assert [cfg.windowed(i) for i in range(4)] == [True, False, True, False]
    for key in ("global_every", "local_rope_theta"):
        with pytest.raises(zjax.ConfigError, match=rf"^model\.{key}: 2(\.0)? needs "):
            LlamaConfig(**{key: 2})


def test_rotary_is_a_complex_rotation_of_half_pairs():
    x = np.random.default_rng(0).normal(size=(2, 7, 3, 8)).astype(np.float32)
    got = np.asarray(rotary(jnp.asarray(x), 500000.0))
    np.testing.assert_allclose(got, _np_rotary(x.astype(np.float64), 500000.0), atol=1e-5)
    # position 0 is not rotated; the norm of every pair is kept
    np.testing.assert_allclose(got[:, 0], x[:, 0], atol=1e-6)
    np.testing.assert_allclose(np.hypot(got[..., :4], got[..., 4:]),
                               np.hypot(x[..., :4], x[..., 4:]), rtol=1e-5)


def test_forward_equals_an_independent_implementation():
    params = llama_trainable().init(jax.random.key(1))
    # a larger init than Llama's 0.02, so attention is far from uniform and the test sharp
    params = jax.tree.map(lambda a: a * 8 if a.ndim > 1 else a + 0.1, params)
    tokens = token_batches(1, batch=2, seq=15)[0][:, :-1]
    from flax import nnx

    from zjax.models import Llama

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(TINY_LLAMA, rngs=nnx.Rngs(0))))
    got = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(tokens)))
    want = _np_llama(params, tokens, TINY_LLAMA)
    assert np.abs(want).max() > 1.0  # logits far from zero: the comparison means something
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def reference():
    batches = token_batches(5)
    return batches, reference_run(llama_trainable().init, llama_reference_loss(), make_tx(),
                                  batches)


@pytest.mark.parametrize(("stage", "prefetch", "data", "model"), [
    pytest.param(3, 1, 8, 1, marks=pytest.mark.slow),
    pytest.param(3, 1, 4, 2),  # the quick loop's case: ZeRO-3 with a model axis
    *(pytest.param(s, p, 8, 1, marks=pytest.mark.slow) for s, p in
      [(0, 0), (1, 0), (2, 0), (3, 0), (3, 2)]),
])
def test_training_matches_single_device(reference, stage, prefetch, data, model):
    batches, expected = reference
    zero = zjax.ZeroConfig(stage=stage, prefetch_layers=prefetch, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")
    mesh = zjax.make_mesh(zjax.MeshConfig(data=data, model=model))
    zstep, state, losses = train_steps(llama_trainable(), zero, batches, mesh=mesh)
    assert_matches_reference(losses, state, expected)
    if model > 1:  # query and key/value heads and the MLP split over model
        by = zstep.plan.leaves_by_path
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            assert by[f"blocks/layers/{name}"].model_dim is not None, name


def test_config_errors_name_the_key():
    with pytest.raises(zjax.ConfigError, match=r"^model\.n_kv_heads: 3 does not divide "
                                               r"model\.n_heads 4"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(zjax.ConfigError, match=r"^model\.n_heads: .* 5 dimensions .* odd"):
        LlamaConfig(d_model=20, n_heads=4)
    config = load_config(ROOT / "configs/llama-tiny.yaml", ["mesh.model=4", "mesh.data=2"])
    with pytest.raises(zjax.ConfigError, match=r"^mesh\.model: the model axis \(4\) does not "
                                               r"divide the 2 key/value heads"):
        zjax.plan(config)
    assert LlamaConfig(d_model=4096, n_heads=32).ff == 11008  # Llama 2 7B's hidden width


@pytest.mark.slow
@pytest.mark.long_training
def test_template_trains_and_its_memory_is_flat_in_depth():
    """configs/llama-tiny.yaml learns in 60 steps (the first row is step 20); stage 3's temp
    grows by less than one gathered layer per added layer (the GPT's criterion)."""
    cfg = load_config(ROOT / "configs/llama-tiny.yaml",
                      ["train.steps=60", "train.log_every=20", "train.eval_every=0"])
    history = zjax.train(None, cfg).history
    # untrained: ln 256 = 5.55 nats per byte
    assert history[-1]["loss"] < min(history[0]["loss"] - 0.2, np.log(256) - 2.5), history
    temps = []
    for n_layers in (4, 8):
        c = load_config(ROOT / "configs/llama-tiny.yaml", [f"model.n_layers={n_layers}"])
        temps.append(zjax.plan(c).per_device["temp_bytes"])
        layer = sum(leaf.size // leaf.shape[0] for leaf in zjax.build_step(c).plan.leaves
                    if leaf.stacked) * 2  # bf16 gathers
    assert (temps[1] - temps[0]) / 4 < layer, (temps, layer)
