"""A reference decoder-only GPT in Flax NNX: pre-norm attention + MLP blocks in a ``Stack``.

Weights compute in whatever dtype they arrive in (zjax hands them over in ``zero.gather_dtype``);
normalisation statistics, softmax and logits are float32.

Every weight names its dimensions (``out_sharding`` metadata, Flax's logical axes): ``embed``,
``heads``, ``mlp``, ``vocab``. On a mesh with ``model`` > 1 the rules split heads and the MLP
hidden dimension (Megatron's layout), a block receives its local slices and computes with local
head counts, and :mod:`zjax.nn.tensor_parallel` marks where partial results are summed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from zjax.errors import ArgumentError
from zjax.lora import LoraConfig
from zjax.models._batch import Packing
from zjax.models._layers import KVCache, LayerNorm, RMSNorm, check_length, param, zeros
from zjax.models._linears import AdaptedLinears, Modules
from zjax.models._lm import lm_loss
from zjax.models.config import GPTConfig
from zjax.nn import Stack, column_parallel_input, model_axis_size, row_parallel_output
from zjax.nn.attention import attention
from zjax.partition.rows import take_rows

__all__ = ["GPT", "LINEAR_WEIGHTS", "GPTConfig", "lm_loss"]

# the linear weights' logical axes, and GPT-2's module names for them (lora.targets): c_attn
# fuses q, k and v; c_proj names the attention's and the MLP's output projections
LINEAR_AXES = {"wq": ("embed", "heads"), "wk": ("embed", "heads"), "wv": ("embed", "heads"),
               "wo": ("heads", "embed"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
LINEAR_WEIGHTS = tuple(LINEAR_AXES)
MODULES: Modules = {"c_attn": (("wq", "wk", "wv"),), "c_proj": (("wo",), ("w_down",)),
                    "c_fc": (("w_up",),)}


def norm(cfg: GPTConfig) -> nnx.Module:
    """The normalisation ``model.norm`` names."""
    cls = LayerNorm if cfg.norm == "layer" else RMSNorm
    return cls(cfg.d_model, cfg.norm_eps)


class Block(AdaptedLinears, nnx.Module):
    """Pre-norm causal self-attention and GELU MLP (biases with ``model.bias``).

    QKV and up projections are column-parallel, the output and down projections row-parallel:
    with the weights split over ``model`` each device runs ``n_heads / model`` heads and
    ``d_ff / model`` hidden units, and two all-reduces per block sum the partial outputs.
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        d, ff = cfg.d_model, cfg.ff
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual projections
        self.n_heads = cfg.n_heads
        self.ln1 = norm(cfg)
        self.wq = param(rngs, (d, d), 0.02, ("embed", "heads"))
        self.wk = param(rngs, (d, d), 0.02, ("embed", "heads"))
        self.wv = param(rngs, (d, d), 0.02, ("embed", "heads"))
        self.wo = param(rngs, (d, d), out_std, ("heads", "embed"))
        self.ln2 = norm(cfg)
        self.w_up = param(rngs, (d, ff), 0.02, ("embed", "mlp"))
        self.w_down = param(rngs, (ff, d), out_std, ("mlp", "embed"))
        if cfg.bias:  # GPT-2's; the output biases are added after the tensor-parallel sum
            self.bq, self.bk, self.bv = (zeros((d,), ("heads",)) for _ in range(3))
            self.bo, self.b_up = zeros((d,), ("embed",)), zeros((ff,), ("mlp",))
            self.b_down = zeros((d,), ("embed",))
        self.bias = cfg.bias
        self.attention, self.mlp_chunk = cfg.attention, cfg.mlp_chunk
        self.context_attention = cfg.context_attention
        self._init_adapters(lora, rngs, modules=MODULES, axes=LINEAR_AXES, model="a GPT",
                            mlp_chunk=cfg.mlp_chunk, fp8=cfg.fp8)

    def _plus(self, x, name: str):
        return x + getattr(self, name)[...] if self.bias else x

    def _mlp(self, y, drop=None):  # token-wise: tiled over chunks of tokens (model.mlp_chunk)
        up = jax.nn.gelu(self._plus(self._linear(y, "w_up", drop=drop), "b_up"))  # GPT-2's tanh
        return self._linear(up, "w_down", row_parallel=True, drop=drop)

    def __call__(self, x, cache: KVCache | None = None, start=0, *,
                 context: Packing | None = None, layer: jax.Array | None = None,
                 pads: jax.Array | None = None):
        """The block on ``x`` ``[B, T, D]``; with a ``cache`` (decoding), ``x`` is at
        positions ``start``.. and ``(y, cache)`` comes back; ``context``: packed documents
        (attention stays within each); ``layer``: this block's index (with dropout on
        adapters); ``pads``: decoding only, int ``[B]``: the padding positions that lead
        each row of the cache (left-padded prompts), which no query sees."""
        b, t, d = x.shape
        hd = d // self.n_heads
        m = model_axis_size()
        if self.n_heads % m:
            raise ArgumentError("mesh", f"the model axis ({m}) does not divide the "
                                f"{self.n_heads} attention heads (model.n_heads), which it splits")
        h = self.wq.get_value().shape[-1] // hd  # this device's heads
        drop = self._dropout(context, layer)
        y = column_parallel_input(self.ln1(x))
        q, k, v = (self._plus(self._linear(y, f"w{n}", drop=drop), f"b{n}").reshape(b, t, h, hd)
                   for n in "qkv")
        if cache is not None:  # keys and values of the earlier positions, these written in
            cache = cache.write(k, v, start)
            # padding keys are hidden (a padding query, seeing none, gets a finite average)
            ids = None if pads is None else (
                jnp.ones((b, t), jnp.int32),
                (jnp.arange(cache.k.shape[1]) >= pads[:, None]).astype(jnp.int32))
            att = attention(q, cache.k, cache.v, q_start=start, implementation="dense",
                            segment_ids=ids)
        else:
            att = attention(q, k, v, implementation=self.attention,
                            context=self.context_attention,
                            segment_ids=None if context is None else context.segment_ids)
        att = att.reshape(b, t, h * hd)
        x = self._plus(x + row_parallel_output(self._linear(att, "wo", row_parallel=True,
                                                            drop=drop)), "bo")
        y = column_parallel_input(self.ln2(x))
        mlp = functools.partial(self._mlp, drop=drop)
        ins = ("w_up", "b_up") if self.bias else ("w_up",)
        out = self._tiled(mlp, y, self.mlp_chunk,
                          lambda x, w, *b: jax.nn.gelu(x @ w + (b[0] if b else 0)), ins, "w_down")
        x = self._plus(x + row_parallel_output(out), "b_down")
        return x if cache is None else (x, cache)


class GPT(nnx.Module):
    """Token + learned position embeddings, a ``Stack`` of blocks, final norm, LM head."""

    # lora.targets' names (Hugging Face module -> its weights) and the weights a quantized
    # base stores quantized
    LORA_MODULES = MODULES
    LINEAR_WEIGHTS = LINEAR_WEIGHTS

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), 0.02, ("vocab", "embed"))
        if not cfg.tie_embeddings:  # read by take_rows alone: looked up where its rows live
            self.embed.set_metadata(rows=True)
        self.pos = param(rngs, (cfg.max_seq_len, cfg.d_model), 0.01, (None, "embed"))
        dropout = lora is not None and lora.enabled and lora.dropout > 0  # a mask per layer
        self.blocks = Stack(lambda r: Block(cfg, rngs=r, lora=lora), cfg.n_layers, rngs=rngs,
                            remat=cfg.remat, indexed=dropout)
        self.ln_f = norm(cfg)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), 0.02, ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, packing: Packing | None = None) -> jax.Array:
        """Float32 logits ``[B, T, vocab]`` for int tokens ``[B, T]``."""
        return (self.features(tokens, packing) @ self.head_weight()).astype(jnp.float32)

    def features(self, tokens: jax.Array, packing: Packing | None = None) -> jax.Array:
        """The final normalised hidden states ``[B, T, D]`` (what the head multiplies)."""
        check_length(tokens, self.cfg.max_seq_len)
        positions = None if packing is None else packing.positions
        return self.ln_f(self.blocks(self._embed(tokens, 0, positions), packing))

    def head_weight(self) -> jax.Array:
        """The LM head ``[D, vocab]`` (the token embedding's transpose when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.head[...]

    def _embed(self, tokens, start, positions=None):
        t = tokens.shape[1]
        if positions is not None:  # packed documents (each restarts at 0), left-padded rows
            pos = jnp.take(self.pos[...], positions, axis=0)
        elif isinstance(start, int):
            pos = self.pos[...][start:start + t]
        else:
            pos = jax.lax.dynamic_slice_in_dim(self.pos[...], start, t)
        x = take_rows(self.embed.get_value(), tokens)
        return x + pos.astype(x.dtype)

    def _logits(self, h):
        return (self.ln_f(h) @ self.head_weight()).astype(jnp.float32)

    def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> KVCache:
        """An empty key/value cache for ``batch`` sequences of up to ``length`` tokens
        (at most ``max_seq_len``: the position table's size)."""
        cfg = self.cfg
        return KVCache.zeros(cfg.n_layers, batch, length, cfg.n_heads,
                             cfg.d_model // cfg.n_heads, dtype)

    def decode(self, tokens: jax.Array, cache: KVCache, start, *,
               pads: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Logits of ``tokens`` ``[B, T]`` at cache indices ``start``.., attending to the
        ``cache``'s earlier positions: a prompt (``start`` 0), then one token at a time.

        ``pads``: int ``[B]``, how many padding positions lead each row (prompts of different
        lengths, left-padded to one): row ``b``'s token at index ``i`` takes position
        ``max(i - pads[b], 0)``'s embedding and no query attends to its padding. None: no
        padding.
        """
        positions = None if pads is None else jnp.maximum(
            start + jnp.arange(tokens.shape[1]) - pads[:, None], 0)
        h, cache = self.blocks.decode(self._embed(tokens, start, positions), cache, start,
                                      pads=pads)
        return self._logits(h), cache

