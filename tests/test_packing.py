"""Packed documents and the chunked loss.

A row holding two documents (segment ids, positions restarting in each) gives each document
the per-token losses and the gradients it gets alone, in both reference models, in plain JAX
and through the ZeRO-3 step's scheduled layer scan; the chunked cross-entropy equals the plain
one in values and gradients. Tolerance: float32, 1e-5 relative / 1e-6 absolute (the same
arithmetic in another order).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close

import zjax
from zjax.errors import ArgumentError
from zjax.models import GPT, GPTConfig, Llama, LlamaConfig, lm_loss
from zjax.models._batch import positions_from_segments, split_batch
from zjax.nn.loss import chunked_cross_entropy

TOL = dict(rtol=1e-5, atol=1e-6)
A, B = 21, 11  # the two documents' lengths (tokens, targets included)


def _model(kind: str, **kw):
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, **kw)
        return GPT(cfg, rngs=nnx.Rngs(0))
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=48, max_seq_len=64, tie_embeddings=False, **kw)
    return Llama(cfg, rngs=nnx.Rngs(0))


def _docs():
    rng = np.random.default_rng(0)
    return rng.integers(1, 64, A).astype(np.int32), rng.integers(1, 64, B).astype(np.int32)


def _packed(a, b):
    tokens = np.concatenate([a, b])[None]
    seg = np.concatenate([np.ones(A, np.int32), np.full(B, 2, np.int32)])[None]
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(seg)}


def _per_token(model, batch):
    weights = split_batch(batch)[2]
    losses = _jit_per_token(*nnx.split(model), batch)
    return losses if weights is None else losses[weights > 0]


@functools.partial(jax.jit, static_argnums=0)
def _jit_per_token(graphdef, state, batch):
    # jitted: each eager op of a model dispatches on its own (minutes for these few rows)
    model = nnx.merge(graphdef, state)
    inputs, targets, _, packing = split_batch(batch)
    return chunked_cross_entropy(model.features(inputs, packing), model.head_weight(),
                                 targets, chunk=model.cfg.loss_chunk)


def _loss_and_grads(model, batch):
    graphdef, params = nnx.split(model, nnx.Param)
    return _jit_loss_and_grads(graphdef, params, batch)


@functools.partial(jax.jit, static_argnums=0)
def _jit_loss_and_grads(graphdef, params, batch):
    return jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p), batch)[0])(params)


_SLOW = pytest.mark.slow  # the fast loop keeps one case (each compiles two models)


@pytest.mark.parametrize("kind,attention", [
    ("gpt", "blockwise"), pytest.param("gpt", "dense", marks=_SLOW),
    pytest.param("llama", "dense", marks=_SLOW), pytest.param("llama", "blockwise", marks=_SLOW)])
def test_a_packed_row_equals_its_documents_run_alone(kind, attention):
    """The GPT's learned positions catch positions that do not restart; rotary scores
    depend on position differences only, so the Llama's catch the segment mask."""
    model = _model(kind, attention=attention)
    a, b = _docs()
    packed = _packed(a, b)
    alone = np.concatenate([_per_token(model, jnp.asarray(a)[None]),
                            _per_token(model, jnp.asarray(b)[None])], axis=None)
    np.testing.assert_allclose(_per_token(model, packed), alone.reshape(-1), **TOL)
    total, grads = _loss_and_grads(model, packed)
    (la, ga), (lb, gb) = (_loss_and_grads(model, jnp.asarray(d)[None]) for d in (a, b))
    np.testing.assert_allclose(total, la + lb, **TOL)
    assert_trees_close(grads, jax.tree.map(jnp.add, ga, gb), **TOL, what="grads")
    assert float(lm_loss(model, packed)[1]) == (A - 1) + (B - 1)  # the boundary excluded


def test_positions_restart_in_each_document_and_padding_is_not_learned():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0]])
    np.testing.assert_array_equal(positions_from_segments(seg), [[0, 1, 2, 0, 1, 0, 1]])
    batch = {"tokens": jnp.arange(7)[None], "segment_ids": seg,
             "loss_mask": jnp.asarray([[1, 1, 0, 1, 1, 1, 1]])}
    _, _, weights, _ = split_batch(batch)
    # targets 1..6: 1 ok, 2 masked, 3 crosses a boundary, 4 ok, 5 and 6 padding
    np.testing.assert_array_equal(weights, [[1, 0, 0, 1, 0, 0]])
    with pytest.raises(ArgumentError, match="positions need segment_ids"):
        split_batch({"tokens": seg, "positions": seg})
    with pytest.raises(ArgumentError, match="got \\['labels', 'tokens'\\]"):
        split_batch({"tokens": seg, "labels": seg})


@pytest.mark.parametrize("chunk", [7, 64, 4096])
@pytest.mark.parametrize("tied", [True, False])
def test_the_chunked_loss_equals_the_plain_loss_and_its_gradients(chunk, tied):
    h = jax.random.normal(jax.random.PRNGKey(0), (3, 30, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 50)) * 0.3
    targets = jax.random.randint(jax.random.PRNGKey(2), (3, 30), 0, 50)
    weights = jax.random.uniform(jax.random.PRNGKey(3), (3, 30))

    def plain(h, w):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(h @ w, targets) * weights)

    def chunked(h, w):
        return jnp.sum(chunked_cross_entropy(h, w, targets, chunk=chunk) * weights)

    if tied:  # the head is the embedding's transpose
        plain_t, chunked_t = (lambda f: lambda h, e: f(h, e.T))(plain), \
            (lambda f: lambda h, e: f(h, e.T))(chunked)
        w = w.T
    else:
        plain_t, chunked_t = plain, chunked
    want, want_g = jax.value_and_grad(plain_t, argnums=(0, 1))(h, w)
    got, got_g = jax.value_and_grad(chunked_t, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(got, want, **TOL)
    assert_trees_close(got_g, want_g, **TOL, what="grads")


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_few_tokens_next_to_a_wide_vocabulary_take_the_backward_by_vocabulary_slices(softcap):
    """90 tokens, a 512-entry vocabulary, chunks of 16: the backward goes over 8 slices of the
    vocabulary (the head's gradient written slice by slice, not summed over chunks) and
    equals plain JAX's gradients, softcapped and at a sampling temperature too."""
    from zjax.nn import loss

    assert loss._vocab_pieces(90, 64, 512, 16, 4) == 8
    assert loss._vocab_pieces(90, 64, 509, 16, 4) == 0  # a prime vocabulary: token chunks
    h = jax.random.normal(jax.random.PRNGKey(0), (3, 30, 64))
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 512)) * 0.1
    targets = jax.random.randint(jax.random.PRNGKey(2), (3, 30), 0, 512)
    weights = jax.random.uniform(jax.random.PRNGKey(3), (3, 30))

    def plain(h, w):
        z = h @ w
        z = z if softcap is None else softcap * jnp.tanh(z / softcap)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(z / 0.7, targets)
                       * weights)

    def chunked(h, w):
        return jnp.sum(chunked_cross_entropy(h, w, targets, chunk=16, softcap=softcap,
                                             temperature=0.7) * weights)

    want, want_g = jax.value_and_grad(plain, argnums=(0, 1))(h, w)
    got, got_g = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(got, want, **TOL)
    assert_trees_close(got_g, want_g, **TOL, what="grads")


def test_the_backward_by_vocabulary_slices_holds_less_than_token_chunks(monkeypatch):
    """512 tokens, D 1024, a 32768-entry bfloat16 head, chunks of 128: token chunks hold a
    float32 sum of the head's gradient (measured 386.5 MiB of temp), four vocabulary slices
    do not (196.0 MiB)."""
    from zjax.nn import loss

    def temp():
        args = (jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),
                jax.ShapeDtypeStruct((1024, 32768), jnp.bfloat16),
                jax.ShapeDtypeStruct((512,), jnp.int32))
        grad = jax.grad(lambda h, w, t: jnp.sum(chunked_cross_entropy(h, w, t, chunk=128)),
                        argnums=(0, 1))
        return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    by_vocab = temp()
    monkeypatch.setattr(loss, "_vocab_pieces", lambda *a: 0)
    by_tokens = temp()
    assert by_vocab < 0.6 * by_tokens, (by_vocab, by_tokens)


@pytest.mark.slow
def test_the_zero3_step_takes_packed_batches():
    """The scheduled layer scan carries the segment ids and positions to every layer: the
    step's loss and gradients on a packed batch are plain JAX's."""
    config = zjax.load_config("configs/llama-tiny.yaml",
                              ["model.n_layers=2", "data.seq_len=31", "data.batch_size=8",
                               "model.attention=blockwise", "zero.gather_dtype=float32"])
    zstep = zjax.build_step(config)
    a, b = _docs()
    row = _packed(a, b)
    batch = {k: jnp.tile(v, (8, 1)) for k, v in row.items()}
    state = zstep.init(jax.random.key(0))
    graphdef, _ = nnx.split(Llama(config.model, rngs=nnx.Rngs(0)))
    params = jax.device_get(state.params)

    def mean_loss(p):
        total, count = lm_loss(nnx.merge(graphdef, p), batch)
        return total / count

    want, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    _, metrics = zstep.step(state, zstep.put_batch(batch))
    np.testing.assert_allclose(metrics["loss"], want, **TOL)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-4)
    assert float(metrics["count"]) == 8 * ((A - 1) + (B - 1))
