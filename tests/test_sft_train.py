"""Fine-tuning batches in the model and the step: packed windows equal their documents run
apart (dense and the long-context blockwise attention), a completion-only loss ignores the
prompt's targets, and gradient accumulation over
micro-batches of uneven loss-token counts equals one batch (the mean over the global batch's
loss tokens, not a mean of micro-batch means).

Tolerance: float32, 1e-5 relative / 1e-6 absolute (the same arithmetic in another order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close
from sft_data import chat_dir

import zjax
from zjax.data import DataConfig, load_corpus, pack
from zjax.models import Llama, LlamaConfig, lm_loss
from zjax.models._batch import split_batch
from zjax.nn.loss import chunked_cross_entropy

TOL = dict(rtol=1e-5, atol=1e-6)
ZERO = zjax.ZeroConfig(stage=3, gather_dtype="float32")
CFG = LlamaConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                  max_seq_len=128, tie_embeddings=False, attention="dense")


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    tokenizer, rows = chat_dir(tmp_path_factory.mktemp("chat"), n=40)
    data = DataConfig(tokenizer=str(tokenizer), format="chat")
    return load_corpus(data, source=rows).sources[0][0]


def _batch(windows, idx) -> dict:
    """The windows ``idx`` as one batch."""
    return {k: jnp.asarray(np.stack([windows[i][k] for i in idx])) for k in windows[0]}


@functools.partial(jax.jit, static_argnums=0)
def _sum_and_grads(graphdef, params, batch):
    """``((loss sum, its gradients), loss-token count)``."""
    (total, count), grads = jax.value_and_grad(
        lambda p: lm_loss(nnx.merge(graphdef, p), batch), has_aux=True)(params)
    return (total, grads), count


@pytest.mark.parametrize("attention", ["dense", pytest.param("blockwise",
                                                             marks=pytest.mark.slow)])
def test_packed_windows_equal_their_documents_apart(docs, attention):
    cfg = dataclasses.replace(CFG, attention=attention)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    packed = pack(docs, seq_len=127, packing=True)
    apart = pack(docs, seq_len=127, packing=False)
    # the first packed window's documents, each in its own window
    rows = np.searchsorted(apart.starts, packed.starts[:int(packed.bounds[1])])
    assert len(rows) >= 2
    np.testing.assert_array_equal(apart.starts[rows], packed.starts[:len(rows)])
    (want, want_g), want_n = _sum_and_grads(graphdef, params, _batch(apart, rows))
    (got, got_g), got_n = _sum_and_grads(graphdef, params, _batch(packed, [0]))
    assert float(got_n) == float(want_n) > 0
    np.testing.assert_allclose(got, want, **TOL)
    assert_trees_close(got_g, want_g, **TOL, what="gradients")


def test_the_completion_only_gradient_ignores_the_prompt_targets(docs):
    model = Llama(CFG, rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = _batch(pack(docs, seq_len=127, packing=True), [0, 1])
    inputs, targets, weights, packing = split_batch(batch)
    assert 0 < float(weights.sum()) < weights.size
    other = jnp.where(weights > 0, targets, (targets * 7 + 3) % CFG.vocab_size)
    assert bool(jnp.any(other != targets))

    @jax.jit
    def grads(p, t):
        def loss(p):
            m = nnx.merge(graphdef, p)
            per = chunked_cross_entropy(m.features(inputs, packing), m.head_weight(), t,
                                        chunk=CFG.loss_chunk)
            return jnp.sum(per * weights)
        return jax.grad(loss)(p)

    assert_trees_close(grads(params, other), grads(params, targets), rtol=0, atol=0,
                       what="gradients")


@pytest.mark.slow  # two ZeRO-3 steps compiled (35 s)
def test_micro_batches_of_uneven_loss_tokens_equal_one_batch(docs):
    windows = pack(docs, seq_len=63, packing=False)
    counts = [int(split_batch(_batch(windows, [i]))[2].sum()) for i in range(len(windows))]
    order = np.argsort(counts)  # rows of very different loss-token counts
    idx = np.concatenate([order[:16], order[-16:]])
    batch = _batch(windows, idx)
    trainable = zjax.from_nnx(lambda rngs: Llama(CFG, rngs=rngs), lm_loss)
    results = []
    for micro in (1, 4):
        # SGD: the update is the mean gradient itself (Adam's first step is about its sign)
        zstep = zjax.make_step(trainable, optax.sgd(1.0), zero=ZERO,
                               mesh=zjax.make_mesh(), micro_batches=micro)
        state = zstep.init(jax.random.key(0))
        start = jax.device_get(state.params)
        state, metrics = zstep.step(state, zstep.put_batch(batch))
        results.append((jax.device_get(state.params), float(metrics["loss"]),
                        float(metrics["count"])))
    (one, loss1, n1), (four, loss4, n4) = results
    assert n1 == n4 == sum(counts[i] for i in idx)
    np.testing.assert_allclose(loss4, loss1, **TOL)
    assert_trees_close(four, one, **TOL, what="params after one step")
    # the update is plain JAX's gradient of the mean over all loss tokens; the normalisation
    # this avoids (a mean of the micro-batches' means; each of the 8 devices holds 4 rows,
    # micro-batch m its m-th) gives a gradient far from it
    graphdef = nnx.split(Llama(CFG, rngs=nnx.Rngs(0)), nnx.Param)[0]

    def mean_loss(p, b):
        total, count = lm_loss(nnx.merge(graphdef, p), b)
        return total / count

    grad = jax.jit(jax.grad(mean_loss))
    want = grad(start, batch)
    update = jax.tree.map(lambda a, b: a - b, start, four)
    assert_trees_close(update, want, rtol=1e-4, atol=1e-6, what="the update")
    micro = [grad(start, {k: v[m::4] for k, v in batch.items()}) for m in range(4)]
    naive = jax.tree.map(lambda *g: sum(g) / 4, *micro)
    off = optax.tree.norm(jax.tree.map(jnp.subtract, naive, want)) / optax.tree.norm(want)
    assert off > 1e-3, off  # 10x the tolerance the update is held to (measured: ~0.01-0.03)
