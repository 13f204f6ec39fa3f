"""Tiled MLP (``zjax.nn.tiled``, ``model.mlp_chunk``): the same values and gradients as the
untiled MLP, and a layer's working set that stops growing with tokens x d_ff.

Tolerance: float32, 1e-5 relative / 1e-6 absolute (the weights' gradients are summed chunk by
chunk: the same arithmetic in another order).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close, compile_on

import zjax
from zjax.models import GPT, GPTConfig, Llama, LlamaConfig, lm_loss
from zjax.nn import tiled

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


def _temp(*overrides):
    config = zjax.load_config("configs/llama-tiny.yaml", [
        "model.n_layers=2", "model.d_model=128", "model.d_ff=2048", "data.seq_len=4096",
        "model.max_seq_len=4096", "data.batch_size=8", "model.attention=blockwise",
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
