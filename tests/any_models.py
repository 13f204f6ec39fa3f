"""Models zjax does not own, written the way their libraries' users write them: plain JAX,
Flax Linen and Equinox, each as an unrolled Python loop of layers and as a scan over stacked
layers. Each factory returns ``(init, loss)`` for :func:`zjax.from_pytree`:
``loss(params, tokens[B, T+1]) -> (sum of token losses, count)``, a pre-norm MLP language
model with a tied embedding."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import compile_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from zjax.errors import GatherFallbackWarning
from zjax.partition import ZeroConfig


def _lm_loss(logits, tokens):
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(logz - picked), jnp.asarray(picked.size, jnp.float32)


# -- plain JAX --------------------------------------------------------------------------------

def _jax_layer(key, d, f):
    k1, k2 = jax.random.split(key)
    return {"ln": jnp.ones((d,)), "up": jax.random.normal(k1, (d, f)) * d ** -0.5,
            "down": jax.random.normal(k2, (f, d)) * f ** -0.5}


def _jax_block(p, h):
    y = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["ln"]
    return h + jax.nn.gelu(y @ p["up"]) @ p["down"]


def jax_loop(*, vocab=64, d=32, f=128, n_layers=3, remat=False):
    """Per-layer dicts in a list, run by a Python loop (as HF Flax GPT-2 runs its blocks)."""
    block = jax.checkpoint(_jax_block) if remat else _jax_block

    def init(rng):
        keys = jax.random.split(rng, n_layers + 1)
        return {"embed": jax.random.normal(keys[0], (vocab, d)) * 0.3,
                "layers": [_jax_layer(k, d, f) for k in keys[1:]]}

    def loss(params, tokens):
        p = jax.tree.map(lambda x: x.astype(jnp.float32), params)  # a cast up front: views
        h = p["embed"][tokens[:, :-1]]
        for layer in p["layers"]:
            h = block(layer, h)
        return _lm_loss(h @ p["embed"].T, tokens)

    return init, loss


def jax_scan(*, vocab=64, d=32, f=128, n_layers=3, remat=False):
    """Stacked layer params run by ``lax.scan`` (inside a ``jax.jit``'d helper); ``remat``
    checkpoints each layer (for the GSPMD baseline of the benchmark)."""
    block = jax.checkpoint(_jax_block) if remat else _jax_block

    def init(rng):
        k0, k1 = jax.random.split(rng)
        layers = [_jax_layer(k, d, f) for k in jax.random.split(k1, n_layers)]
        return {"embed": jax.random.normal(k0, (vocab, d)) * 0.3,
                "stack": jax.tree.map(lambda *x: jnp.stack(x), *layers)}

    @jax.jit
    def trunk(stack, h):
        return jax.lax.scan(lambda h, p: (block(p, h), None), h, stack)[0]

    def loss(params, tokens):
        h = params["embed"][tokens[:, :-1]]
        return _lm_loss(trunk(params["stack"], h) @ params["embed"].T, tokens)

    return init, loss


def jax_flat(*, vocab=64, d=32, f=128, n_layers=3, remat=False):
    """No layer structure: one weight dict read at once (the transform's fallback case)."""
    del n_layers, remat

    def init(rng):
        k0, k1, k2 = jax.random.split(rng, 3)
        return {"embed": jax.random.normal(k0, (vocab, d)) * 0.3,
                "w": {"a": jax.random.normal(k1, (d, f)) * d ** -0.5,
                      "b": jax.random.normal(k2, (f, d)) * f ** -0.5}}

    def loss(params, tokens):
        w = params["w"]
        both = jnp.concatenate([w["a"], w["b"].T], axis=0)  # every weight used in one op
        h = params["embed"][tokens[:, :-1]]
        h = h + jax.nn.gelu(h @ both[:d]) @ both[d:].T
        return _lm_loss(h @ params["embed"].T, tokens)

    return init, loss


# -- Flax Linen --------------------------------------------------------------------------------

class _LinenBlock(linen.Module):
    d: int
    f: int

    @linen.compact
    def __call__(self, h, _=None):
        y = linen.LayerNorm()(h)
        h = h + linen.Dense(self.d)(jax.nn.gelu(linen.Dense(self.f)(y)))
        return h, None


class _LinenLM(linen.Module):
    vocab: int
    d: int
    f: int
    n_layers: int
    scan: bool
    remat: bool = False

    @linen.compact
    def __call__(self, tokens):
        embed = linen.Embed(self.vocab, self.d, name="embed")
        h = embed(tokens)
        if self.scan:
            stack = linen.scan(linen.remat(_LinenBlock), variable_axes={"params": 0},
                               split_rngs={"params": True}, length=self.n_layers)
            h, _ = stack(self.d, self.f, name="blocks")(h, None)
        else:
            block = linen.remat(_LinenBlock) if self.remat else _LinenBlock
            for i in range(self.n_layers):
                h, _ = block(self.d, self.f, name=f"block_{i}")(h)
        return embed.attend(linen.LayerNorm(name="ln_f")(h))


def _linen(scan: bool):
    def factory(*, vocab=64, d=32, f=128, n_layers=3, remat=False):
        model = _LinenLM(vocab, d, f, n_layers, scan, remat)

        def init(rng):
            return model.init(rng, jnp.zeros((1, 8), jnp.int32))["params"]

        def loss(params, tokens):
            return _lm_loss(model.apply({"params": params}, tokens[:, :-1]), tokens)

        return init, loss

    return factory


linen_loop = _linen(scan=False)
linen_loop.__doc__ = "A Flax Linen model with a Python loop of submodules."
linen_scan = _linen(scan=True)
linen_scan.__doc__ = "A Flax Linen model with ``nn.scan`` over ``nn.remat`` blocks."


# -- Equinox -----------------------------------------------------------------------------------

class _EqxBlock(eqx.Module):
    ln: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    act: Callable  # a function field: eqx.filter turns it into a None entry of the params

    def __init__(self, key, d, f):
        k1, k2 = jax.random.split(key)
        self.ln = eqx.nn.LayerNorm(d)
        self.up = eqx.nn.Linear(d, f, key=k1)
        self.down = eqx.nn.Linear(f, d, key=k2)
        self.act = jax.nn.gelu

    def __call__(self, h):  # one token
        return h + self.down(self.act(self.up(self.ln(h))))


class _EqxLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: _EqxBlock  # stacked: every array has a leading layer dimension

    remat: bool = eqx.field(static=True)

    def __init__(self, key, vocab, d, f, n_layers, remat=False):
        k0, k1 = jax.random.split(key)
        self.remat = remat
        self.embed = eqx.nn.Embedding(vocab, d, key=k0)
        self.blocks = eqx.filter_vmap(lambda k: _EqxBlock(k, d, f))(
            jax.random.split(k1, n_layers))

    def __call__(self, tokens):  # one sequence
        h = jax.vmap(self.embed)(tokens)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, layer):
            block = eqx.combine(layer, static)
            return jax.vmap(block)(h), None

        h, _ = jax.lax.scan(jax.checkpoint(step) if self.remat else step, h, dynamic)
        return h @ self.embed.weight.T


def eqx_scan(*, vocab=64, d=32, f=128, n_layers=3, remat=False):
    """An Equinox model with a filtered scan over a stacked block; its params are
    ``eqx.filter(model, eqx.is_inexact_array)``, with None entries."""
    static = eqx.filter(_EqxLM(jax.random.key(0), vocab, d, f, n_layers, remat),
                        eqx.is_inexact_array, inverse=True)

    def init(rng):
        return eqx.filter(_EqxLM(rng, vocab, d, f, n_layers, remat), eqx.is_inexact_array)

    def loss(params, tokens):
        model = eqx.combine(params, static)
        return _lm_loss(jax.vmap(model)(tokens[:, :-1]), tokens)

    return init, loss


MODELS = {"jax_loop": jax_loop, "jax_scan": jax_scan, "linen_loop": linen_loop,
          "linen_scan": linen_scan, "eqx_scan": eqx_scan}


# -- steps of these models ---------------------------------------------------------------------

TX = optax.adam(3e-3, eps=1e-5)


def zero3_step(name, *, n_layers=3, d=32, f=128, gather_dtype="float32", micro_batches=1,
               **zero):
    """``(ZeroStep, init, loss)``: model ``name`` at stage 3, every leaf sharded."""
    init, loss = MODELS[name](n_layers=n_layers, d=d, f=f)
    zero = ZeroConfig(stage=3, param_persistence_threshold=0, gather_dtype=gather_dtype,
                      **zero)
    zstep = zjax.make_step(zjax.from_pytree(init, loss), TX, mesh=zjax.make_mesh(), zero=zero,
                           micro_batches=micro_batches)
    return zstep, init, loss


def train_and_compare(zstep, init, loss, n=5):
    """``n`` steps of ``zstep`` against single-device optax on the same token batches:
    params (the master, where stored apart) and optimizer state within float32 tolerance."""
    from helpers import FP32, assert_trees_close, reference_run
    from models import token_batches

    batches = token_batches(n, batch=16, seq=8)
    state = zstep.init(jax.random.key(0))
    for b in batches:
        state, _ = zstep.step(state, zstep.put_batch(b))
    ref_params, ref_opt, _ = reference_run(init, loss, TX, batches)
    params = state.master if state.master is not None else state.params
    assert_trees_close(params, ref_params, **FP32, what="params")
    assert_trees_close(state.opt_state, ref_opt, **FP32, what="opt_state")


def compiled_step(zstep, batch=16, seq=8):
    """The step compiled for token batches; a model that falls back to gathering everything
    at once is an error."""
    spec = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32,
                                sharding=NamedSharding(zjax.make_mesh(), P("data")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GatherFallbackWarning)  # every model here is layered
        return compile_on(zstep.lower(spec))


def psi_bytes(init, itemsize: int) -> int:
    """Bytes of all params of ``init`` at ``itemsize`` bytes each."""
    return sum(int(np.prod(x.shape)) for x in
               jax.tree.leaves(jax.eval_shape(init, jax.random.key(0)))) * itemsize
