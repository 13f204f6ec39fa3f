"""Tiled MLP (``zjax.nn.tiled``, ``zjax.nn.mlp.tiled_hidden``, ``model.mlp_chunk``): the same
values and gradients as the untiled MLP, a layer's working set that stops growing with
tokens x d_ff, and a tiled step that never holds more than the untiled one (few tokens next
to wide weights: tiling over tokens used to add a sum of the weights' gradients).

Tolerance: float32, 1e-5 relative / 1e-6 absolute (the weights' gradients are summed chunk by
chunk: the same arithmetic in another order); ``helpers.FP32`` for the hidden slices, whose
input gradient is a sum of eight float32 slices (measured: 1.7e-6 at most).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FP32, assert_trees_close, compile_on

import zjax
from zjax.models import GPT, GPTConfig, Llama, LlamaConfig, lm_loss
from zjax.nn import tiled
from zjax.nn.mlp import choose_tiling, tiled_hidden

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [8, 12, 0, 4096])  # divides; padded; off; above the count
def test_tiled_equals_the_function_in_values_and_gradients(chunk):
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (2, 24, 16))
    w1, w2 = jax.random.normal(k[1], (16, 40)) * 0.3, jax.random.normal(k[2], (40, 16)) * 0.3
    g = jax.random.normal(k[3], (2, 24, 16))

    def mlp(x, w1, w2):
        return jax.nn.silu(x @ w1) @ w2

    def loss(fn, x, w1, w2):
        return jnp.sum(fn(x, w1, w2) * g)

    tiled_mlp = lambda x, w1, w2: tiled(lambda y: mlp(y, w1, w2), x, chunk=chunk)
    want, want_g = jax.value_and_grad(functools.partial(loss, mlp), (0, 1, 2))(x, w1, w2)
    got, got_g = jax.jit(jax.value_and_grad(functools.partial(loss, tiled_mlp), (0, 1, 2)))(
        x, w1, w2)
    np.testing.assert_allclose(got, want, **TOL)
    assert_trees_close(got_g, want_g, **TOL, what="grads")


@pytest.mark.parametrize("chunk", [8, 30, 0])  # 8 slices of 40 hidden units; 2; untiled
def test_tiled_hidden_equals_the_mlp_in_values_and_gradients(chunk):
    k = jax.random.split(jax.random.key(1), 5)
    x, g = jax.random.normal(k[0], (2, 24, 16)), jax.random.normal(k[1], (2, 24, 16))
    gate, up = (jax.random.normal(kk, (16, 40)) * 0.3 for kk in k[2:4])
    down = jax.random.normal(k[4], (40, 16)) * 0.3
    hidden = lambda x, gate, up: jax.nn.silu(x @ gate) * (x @ up)
    mlp = lambda x, gate, up, down: hidden(x, gate, up) @ down
    split = lambda x, gate, up, down: tiled_hidden(hidden, x, (gate, up), down, chunk=chunk)

    def value_and_grad(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * g), (0, 1, 2, 3)))(
            x, gate, up, down)

    (want, want_g), (got, got_g) = value_and_grad(mlp), value_and_grad(split)
    np.testing.assert_allclose(got, want, **FP32)
    assert_trees_close(got_g, want_g, **FP32, what="grads")


@pytest.mark.parametrize("kind", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_model_with_a_tiled_mlp_has_the_untiled_loss_and_gradients(kind):
    def model(chunk):
        if kind == "gpt":
            return GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                 max_seq_len=64, mlp_chunk=chunk), rngs=nnx.Rngs(0))
        return Llama(LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                 n_kv_heads=2, d_ff=48, max_seq_len=64, mlp_chunk=chunk),
                     rngs=nnx.Rngs(0))

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 41)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grad(graphdef, params):
        return jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p), tokens)[0])(params)

    (want, want_g), (got, got_g) = (value_and_grad(*nnx.split(model(c), nnx.Param))
                                    for c in (0, 16))  # 80 tokens: 5 chunks of 16
    np.testing.assert_allclose(got, want, **TOL)
    assert_trees_close(got_g, want_g, **TOL, what="grads")


def _temp(*overrides, base=("model.d_model=128", "model.d_ff=2048", "data.seq_len=4096",
                             "model.max_seq_len=4096", "data.batch_size=8",
                             "model.attention=blockwise")):
    config = zjax.load_config("configs/llama-tiny.yaml", ["model.n_layers=2", *base,
                                                          *overrides])
    zstep = zjax.build_step(config)
    return compile_on(zstep.lower(zjax.abstract_batch(config))).memory_analysis()\
        .temp_size_in_bytes


@pytest.mark.slow
def test_the_tiled_mlp_step_holds_one_chunk_of_hidden_units():
    """A 4096-token sequence per device through a 2048-wide SwiGLU MLP: each of its
    [4096, 2048] bfloat16 hidden tensors is 16 MiB. Tiled by 512 tokens the ZeRO-3 step's temp
    falls by more than six of them (measured: 223.3 -> 60.2 MB; 77.5 MB at 1024 tokens,
    112.1 MB at 2048)."""
    plain, tiled_ = _temp(), _temp("model.mlp_chunk=512")
    hidden = 4096 * 2048 * 2
    assert plain - tiled_ >= 6 * hidden, (plain, tiled_)


def test_tiling_never_holds_more_than_the_untiled_step():
    """256 tokens a device through a 2048 x 8192 SwiGLU MLP: its hidden units are 4 MiB a
    tensor, its weights 32 MiB a matrix. Tiled over tokens the step held 120 MiB more (571.2
    -> 691.7 MiB: the weights' gradients summed over the chunks), sliced over hidden units 75
    MiB more (the weight slices); neither is chosen, and the step is the untiled one."""
    base = ("model.d_model=2048", "model.d_ff=8192", "model.n_heads=16", "model.n_kv_heads=2",
            "data.batch_size=16", "data.seq_len=128")
    plain, tiled_ = _temp(base=base), _temp("model.mlp_chunk=64", base=base)
    assert tiled_ <= plain, (plain, tiled_)
    # no divisor of d_ff near the slices wanted (a prime): no hidden slivers, tokens instead
    assert choose_tiling(tokens=1024, d_model=1024, d_ff=8191, chunk=128, act_bytes=2,
                         weight_bytes=3 * 1024 * 8191 * 2, trainable=True) == ("tokens", 8)


@pytest.mark.slow
def test_sliced_hidden_units_hold_less_than_token_chunks_where_weights_are_wide(monkeypatch):
    """1024 tokens a device, d_model 1024, d_ff 8192, chunks of 128 tokens: tiling over
    tokens holds the weights' gradient sums (measured 421.3 -> 355.2 MiB), slicing the hidden
    units (the choice) does not (325.3 MiB)."""
    import zjax.models._linears as linears

    base = ("model.d_model=1024", "model.d_ff=8192", "model.n_heads=8", "model.n_kv_heads=2",
            "data.batch_size=64", "data.seq_len=128")
    plain, chosen = _temp(base=base), _temp("model.mlp_chunk=128", base=base)
    monkeypatch.setattr(linears, "choose_tiling", lambda **kw: ("tokens", 8))
    by_tokens = _temp("model.mlp_chunk=128", base=base)
    assert chosen < by_tokens < plain, (chosen, by_tokens, plain)
