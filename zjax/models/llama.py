"""A reference Llama-family decoder in Flax NNX: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, untied head; the layers in a ``Stack``. Options (``LlamaConfig``) give
Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's head norms and width, Gemma's
1 + w norms, scaled embeddings and GELU-gated MLP, Mixtral's, Qwen3-MoE's and DeepSeek's
mixture of experts in place of the MLP (:mod:`zjax.nn.moe`), DeepSeek's latent attention
(:mod:`zjax.models._mla`), dense first layers and multi-token prediction.

The layout and conventions are Hugging Face's ``LlamaForCausalLM``: rotary embeddings rotate
the two halves of each head (``rotate_half``), query head ``j`` reads key/value head
``j // (n_heads / n_kv_heads)``. Weights are stored ``[in, out]`` (the transpose of PyTorch's
``nn.Linear``). Normalisation statistics, rotary angles, softmax and logits are float32; the
matmuls run in whatever dtype the weights arrive in (``zero.gather_dtype``).

Tensor parallelism as in the GPT (Megatron's layout): query and key/value heads and the MLP
hidden units split over ``model``, so ``mesh.model`` must divide ``n_kv_heads`` (and with it
``n_heads``) and ``d_ff``. A weight whole on every device but used on this device's heads
(Qwen3's head-norm scales) enters as a column-parallel input, so its gradient is summed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from zjax.errors import ArgumentError, ConfigError
from zjax.lora import LoraConfig
from zjax.models._batch import Packing
from zjax.models._layers import KVCache, RMSNorm, check_length, param, zeros
from zjax.models._linears import AdaptedLinears
from zjax.models._llama_linears import EXPERT_AXES, LINEAR_AXES, LINEAR_WEIGHTS, MODULES
from zjax.models._mla import MLA, init_mla, mla_cache, mla_decode, mla_qkv
from zjax.models._rope import llama3_frequencies, rotary, yarn_frequencies
from zjax.models.config import LlamaConfig
from zjax.nn import Stack, column_parallel_input, model_axis_size, row_parallel_output
from zjax.nn.attention import attention
from zjax.nn.moe import Experts, RouterStats, Scoring, moe_ffn
from zjax.partition.rows import take_rows

__all__ = ["LINEAR_WEIGHTS", "Llama", "LlamaConfig", "llama3_frequencies", "rotary",
           "yarn_frequencies"]


# the gated MLP's activation (model.mlp_activation)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


class LlamaBlock(AdaptedLinears, nnx.Module):
    """Pre-norm grouped-query attention and a gated MLP (SwiGLU, or Gemma's GELU), no biases
    (but Qwen2's on q, k, v); optionally Qwen3's per-head query/key norms, Mistral's sliding
    window, and Gemma 2/3's output norms, soft-cap and windowed layers between global ones
    (the block is then called with its ``layer`` index, and its kind taken from it)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        d, hd, ff = cfg.d_model, cfg.head_width, cfg.ff
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.n_kv_heads, self.head_dim = cfg.kv_heads, hd
        self.rope, self.local_rope = cfg.rope, cfg.local_rope
        self.attention, self.mlp_chunk = cfg.attention, cfg.mlp_chunk
        self.context_attention = cfg.context_attention
        self.window, self.global_every = cfg.sliding_window, cfg.global_every
        self.softcap = cfg.attn_softcap
        self.scale = None if cfg.query_pre_attn_scalar is None \
            else cfg.query_pre_attn_scalar ** -0.5
        self.mlp_activation = cfg.mlp_activation
        self.ln1 = RMSNorm(d, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.mla = init_mla(self, cfg, rngs, out_std) if cfg.kv_lora_rank else None
        if self.mla is not None:
            self.scale = self.mla.scale
        else:
            self.wq = param(rngs, (d, cfg.n_heads * hd), 0.02, ("embed", "heads"))
            self.wk = param(rngs, (d, cfg.kv_heads * hd), 0.02, ("embed", "heads"))
            self.wv = param(rngs, (d, cfg.kv_heads * hd), 0.02, ("embed", "heads"))
            self.wo = param(rngs, (cfg.n_heads * hd, d), out_std, ("heads", "embed"))
        if cfg.qkv_bias:  # split with their heads under tensor parallelism
            self.bq = zeros((cfg.n_heads * hd,), ("heads",))
            self.bk = zeros((cfg.kv_heads * hd,), ("heads",))
            self.bv = zeros((cfg.kv_heads * hd,), ("heads",))
        if cfg.qk_norm:  # one scale over a head's width, shared by the heads
            self.q_norm = RMSNorm(hd, cfg.norm_eps, axis=None, plus_one=cfg.norm_plus_one)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, axis=None, plus_one=cfg.norm_plus_one)
        self.ln2 = RMSNorm(d, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        if cfg.post_norms:  # Gemma 2/3: on each sublayer's output, before the residual add
            self.post_attn_norm = RMSNorm(d, cfg.norm_eps, plus_one=cfg.norm_plus_one)
            self.post_mlp_norm = RMSNorm(d, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.moe = cfg.moe
        if cfg.n_experts:
            self._init_experts(cfg, rngs, out_std)
        else:
            self.w_gate = param(rngs, (d, ff), 0.02, ("embed", "mlp"))
            self.w_up = param(rngs, (d, ff), 0.02, ("embed", "mlp"))
            self.w_down = param(rngs, (ff, d), out_std, ("mlp", "embed"))
        self._lora(cfg, lora, rngs)

    def _lora(self, cfg: LlamaConfig, lora: LoraConfig | None, rngs: nnx.Rngs):
        """The adapters (:class:`~zjax.models._linears.AdaptedLinears`); a mixture's
        experts' (``gate_proj``, ``up_proj``, ``down_proj``: ``[E, in, r]`` and
        ``[E, r, out]``) are merged into their weights before the grouped matmuls, so they
        take no dropout; a quantized base quantizes the experts' weights too."""
        axes = LINEAR_AXES
        if lora is not None and lora.enabled and cfg.n_experts:
            experts = [n for n in lora.targets_in(tuple(MODULES), model="a Llama")
                       if n in ("gate_proj", "up_proj", "down_proj")]
            if experts and lora.dropout:
                raise ConfigError(
                    f"lora.dropout: {lora.dropout} on a mixture's experts ({', '.join(experts)}"
                    "), whose adapters are merged into the weights, is not built yet; set it "
                    "to 0 or list the attention projections (q_proj, k_proj, v_proj, o_proj)")
            axes = {**LINEAR_AXES, **EXPERT_AXES}
        self._init_adapters(lora, rngs, modules=MODULES, axes=axes, model="a Llama",
                            mlp_chunk=cfg.mlp_chunk, fp8=cfg.fp8)

    def _init_experts(self, cfg: LlamaConfig, rngs: nnx.Rngs, out_std: float):
        """The router ``[D, E]`` (whole on every device), the routed experts' weights
        ``[E, D, F]`` / ``[E, F, D]`` and the shared experts' gated MLP."""
        d, e, ef = cfg.d_model, cfg.n_experts, cfg.expert_ff
        self.router = param(rngs, (d, e), 0.02, ("embed", None))
        if cfg.router_score == "sigmoid":  # DeepSeek-V3's selection bias (not by gradients)
            self.router_bias = zeros((e,), (None,))
        self.w_gate = param(rngs, (e, d, ef), 0.02, ("expert", "embed", "mlp"))
        self.w_up = param(rngs, (e, d, ef), 0.02, ("expert", "embed", "mlp"))
        self.w_down = param(rngs, (e, ef, d), out_std, ("expert", "mlp", "embed"))
        if cfg.n_shared_experts:
            sf = cfg.n_shared_experts * ef
            self.shared_gate = param(rngs, (d, sf), 0.02, ("embed", "mlp"))
            self.shared_up = param(rngs, (d, sf), 0.02, ("embed", "mlp"))
            self.shared_down = param(rngs, (sf, d), out_std, ("mlp", "embed"))

    def _project(self, y, name: str, drop=None):
        """``y``'s heads of projection ``name`` (``q``, ``k``, ``v``): ``[B, T, heads, hd]``,
        with its bias and head norm where the model has them."""
        out = self._linear(y, f"w{name}", drop=drop)
        if hasattr(self, f"b{name}"):
            out = out + getattr(self, f"b{name}")[...].astype(out.dtype)
        hd = self.head_dim
        out = out.reshape(*y.shape[:2], out.shape[-1] // hd, hd)
        norm = getattr(self, f"{name}_norm", None)
        if norm is None:
            return out
        # the scale is whole on every device but meets only this device's heads: its gradient
        # is summed over the model axis, as a column-parallel input's
        return norm(out, column_parallel_input(norm.scale[...]))

    def _attention(self, y, cache: KVCache | None = None, start=0,
                   context: Packing | None = None, layer=None, drop=None, pads=None):
        b, t, _ = y.shape
        pos = None if context is None else context.positions
        segments = None if context is None else context.segment_ids
        if pads is not None:  # left-padded rows count positions from their first real token
            pos = jnp.maximum(start + jnp.arange(t) - pads[:, None], 0)
        if self.mla is None:
            q, k, v = (self._project(y, name, drop) for name in "qkv")
        elif cache is not None:  # latent attention decodes over its latent cache
            return mla_decode(self, y, cache, start, self.rope, pos, pads)
        else:  # latent attention: its rotary parts rotated already, values padded
            q, k, v = mla_qkv(self, y, self.rope, start, pos, drop)

        def attend(q, k, v, cache, *, window, rope):
            if self.mla is None:
                q, k = (rotary(x, rope[0], start, rope[1], pos) for x in (q, k))
            kw = dict(window=window, softcap=self.softcap, scale=self.scale)
            if cache is None:
                return attention(q, k, v, implementation=self.attention,
                                 context=self.context_attention, segment_ids=segments,
                                 **kw), None
            cache = cache.write(k, v, start)  # these positions' keys and values written in
            # padding keys are hidden (a padding query, seeing none, gets a finite average);
            # windows work on cache indices, which padding does not change
            ids = None if pads is None else (
                jnp.ones((b, t), jnp.int32),
                (jnp.arange(cache.k.shape[1]) >= pads[:, None]).astype(jnp.int32))
            return attention(q, cache.k, cache.v, q_start=start, implementation="dense",
                             segment_ids=ids, **kw), cache

        local = functools.partial(attend, window=self.window, rope=self.local_rope)
        if self.global_every is None:  # every layer alike
            att, cache = local(q, k, v, cache)
        else:  # one branch runs: windowed layers, or every global_every-th global one
            full = functools.partial(attend, window=None, rope=self.rope)
            att, cache = lax.cond((layer + 1) % self.global_every != 0, local, full,
                                  q, k, v, cache)
        if self.mla is not None:  # the values' padding cut off
            att = att[..., :self.mla.v]
        return att.reshape(b, t, q.shape[2] * att.shape[-1]), cache

    def _mlp(self, y, prefix: str = "w", drop=None):  # token-wise: tiled (model.mlp_chunk)
        """The gated MLP of weights ``{prefix}_gate``, ``_up``, ``_down`` (``shared``: the
        shared experts', on flat tokens, which take no dropout)."""
        act = ACTIVATIONS[self.mlp_activation]
        gate, up, down = (f"{prefix}_{n}" for n in ("gate", "up", "down"))
        hidden = act(self._linear(y, gate, drop=drop)) * self._linear(y, up, drop=drop)
        return self._linear(hidden, down, row_parallel=True, drop=drop)

    def _experts(self, y, context: Packing | None, dropless: bool):
        """The mixture of experts on ``y`` ``[B, T, D]`` (normalised, unmarked): the routed
        experts' and the shared experts' partial outputs (split over ``model`` like a dense
        MLP's hidden units) and this layer's router statistics."""
        b, t, d = y.shape
        flat = y.reshape(b * t, d)
        segments = None if context is None else context.segment_ids
        mask = None if segments is None else (segments != 0).reshape(-1)
        moe = self.moe
        out, stats = moe_ffn(
            flat, self.router[...], Experts(*(self._weight(w, dtype=flat.dtype,
                                                           row_parallel=w == "w_down")
                                              for w in ("w_gate", "w_up", "w_down"))),
            k=moe.k, renormalize=moe.renormalize,
            capacity_factor=None if dropless else moe.capacity_factor,
            activation=ACTIVATIONS[self.mlp_activation], mask=mask, matmul=moe.matmul,
            exchange=moe.exchange, chunks=moe.chunks, scoring=self._scoring(),
            sequences=b if moe.seq_aux_loss_coef else None)
        if hasattr(self, "shared_gate"):
            out = out + self._mlp(column_parallel_input(flat), "shared")
        return out.reshape(b, t, d), stats

    def _scoring(self) -> Scoring | None:
        """DeepSeek's router settings (V3's bias, V2's groups and scaling), or None."""
        moe = self.moe
        if moe.sigmoid:
            return Scoring(self.router_bias[...], moe.groups, moe.topk_groups, moe.scaling)
        if moe.groups > 1 or moe.scaling != 1.0:
            return Scoring(None, moe.groups, moe.topk_groups, moe.scaling, sigmoid=False)
        return None

    def __call__(self, x, cache: KVCache | None = None, start=0, *,
                 context: Packing | None = None, layer: jax.Array | None = None,
                 pads: jax.Array | None = None):
        """The block on ``x`` ``[B, T, D]``; with a ``cache`` (decoding), ``x`` is at
        positions ``start``.. and ``(y, cache)`` comes back; ``context``: packed documents;
        ``layer``: this block's index (with ``global_every``: it picks the layer's kind);
        ``pads``: decoding only, int ``[B]``: the padding positions that lead each row of
        the cache (left-padded prompts), which no query sees and positions do not count.
        A mixture of experts' block (``model.n_experts``) in training takes and returns
        ``(x, RouterStats)``, this layer's router statistics added."""
        stats = None
        if isinstance(x, tuple):  # a mixture's layers carry their router statistics
            x, stats = x
        m = model_axis_size()
        if self.mla is not None and m > 1:
            raise ArgumentError("mesh", f"model.kv_lora_rank {self.mla.kv_rank} (latent "
                                "attention) is not split over the model axis yet; set mesh.model "
                                "to 1")
        if self.n_kv_heads % m:
            raise ArgumentError("mesh", f"the model axis ({m}) does not divide the "
                                f"{self.n_kv_heads} key/value heads (model.n_kv_heads), which it "
                                "splits")
        drop = self._dropout(context, layer)
        y = column_parallel_input(self.ln1(x))
        att, new_cache = self._attention(y, cache, start, context, layer, drop, pads)
        x = x + self._post(row_parallel_output(self._linear(att, "wo", row_parallel=True,
                                                            drop=drop)), "post_attn_norm")
        if self.moe is None:
            y = column_parallel_input(self.ln2(x))
            act = ACTIVATIONS[self.mlp_activation]
            out = self._tiled(functools.partial(self._mlp, drop=drop), y, self.mlp_chunk,
                              lambda x, g, u: act(x @ g) * (x @ u), ("w_gate", "w_up"),
                              "w_down")
        else:  # decoding runs dropless: a capacity is a training-time budget
            out, layer_stats = self._experts(self.ln2(x), context, dropless=cache is not None)
            stats = None if stats is None else stats + layer_stats
        x = x + self._post(row_parallel_output(out), "post_mlp_norm")
        if cache is not None:
            return x, new_cache
        return x if stats is None else (x, stats)

    def _post(self, out, name: str):
        """A sublayer's output through its output norm (Gemma 2/3), where the model has one."""
        norm = getattr(self, name, None)
        return out if norm is None else norm(out)


class Llama(nnx.Module):
    """Token embedding, a ``Stack`` of decoder layers, final norm, LM head."""

    # lora.targets' names (Hugging Face module -> its weights) and the weights a quantized
    # base stores quantized
    LORA_MODULES = MODULES
    LINEAR_WEIGHTS = LINEAR_WEIGHTS

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), 0.02, ("vocab", "embed"))
        if not cfg.tie_embeddings:  # read by take_rows alone: looked up where its rows live
            self.embed.set_metadata(rows=True)
        dropout = lora is not None and lora.enabled and lora.dropout > 0  # a mask per layer
        indexed, k = cfg.global_every is not None or dropout, cfg.first_k_dense
        if k:  # DeepSeek's first dense layers: a stack of their own, before the mixture's
            self.dense_blocks = Stack(lambda r: LlamaBlock(cfg.dense_part(), rngs=r, lora=lora),
                                      k, rngs=rngs, remat=cfg.remat, indexed=indexed)
        self.blocks = Stack(lambda r: LlamaBlock(cfg, rngs=r, lora=lora), cfg.n_layers - k,
                            rngs=rngs, remat=cfg.remat, indexed=indexed)
        self.ln_f = RMSNorm(cfg.d_model, cfg.norm_eps, plus_one=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.vocab_size), 0.02, ("embed", "vocab"))
        if cfg.mtp_layers:  # DeepSeek-V3's multi-token prediction module
            norm = functools.partial(RMSNorm, cfg.d_model, cfg.norm_eps,
                                     plus_one=cfg.norm_plus_one)
            self.mtp_enorm, self.mtp_hnorm, self.mtp_norm = norm(), norm(), norm()
            self.mtp_proj = param(rngs, (2 * cfg.d_model, cfg.d_model), 0.02, (None, "embed"))
            self.mtp_blocks = Stack(lambda r: LlamaBlock(cfg, rngs=r, lora=lora), 1, rngs=rngs,
                                    remat=cfg.remat, indexed=indexed)

    def __call__(self, tokens: jax.Array, packing: Packing | None = None) -> jax.Array:
        """Float32 logits ``[B, T, vocab]`` for int tokens ``[B, T]``."""
        return self._softcap(self.features(tokens, packing) @ self.head_weight())

    def features(self, tokens: jax.Array, packing: Packing | None = None) -> jax.Array:
        """The final normalised hidden states ``[B, T, D]`` (what the head multiplies)."""
        return self.features_and_stats(tokens, packing)[0]

    def features_and_stats(self, tokens: jax.Array, packing: Packing | None = None
                           ) -> tuple[jax.Array, RouterStats | None]:
        """:meth:`features`, and a mixture's router statistics summed over its layers
        (None for a dense model)."""
        h, stats = self.hidden_and_stats(tokens, packing)
        return self.ln_f(h), stats

    def hidden_and_stats(self, tokens: jax.Array, packing: Packing | None = None
                         ) -> tuple[jax.Array, RouterStats | None]:
        """The last layer's hidden states (before the final norm) and the router statistics."""
        check_length(tokens, self.cfg.max_seq_len)
        x = self._embed(tokens)
        if self.cfg.first_k_dense:
            x = self.dense_blocks(x, packing)
        if self.cfg.moe is None:
            return self.blocks(x, packing), None
        return self.blocks((x, RouterStats.zeros()), packing)

    def mtp_features(self, hidden: jax.Array, next_tokens: jax.Array,
                     packing: Packing | None = None) -> jax.Array:
        """DeepSeek-V3's multi-token prediction: normalised states ``[B, T, D]`` that the
        shared head reads as the token after next, from the trunk's ``hidden`` states (before
        the final norm) and the next tokens' embeddings (``eh_proj`` over both, normalised,
        embeddings first, then one more layer). Its router statistics are not counted."""
        x = jnp.concatenate([self.mtp_enorm(self._embed(next_tokens)),
                             self.mtp_hnorm(hidden)], axis=-1)
        x = x @ self.mtp_proj[...].astype(x.dtype)
        out = self.mtp_blocks(x if self.cfg.moe is None else (x, RouterStats.zeros()), packing)
        return self.mtp_norm(out if self.cfg.moe is None else out[0])

    def _embed(self, tokens):
        x = take_rows(self.embed.get_value(), tokens)
        if self.cfg.embed_scale:  # Gemma's sqrt(d_model), rounded to the activations' dtype
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), x.dtype)
        return x

    def head_weight(self) -> jax.Array:
        """The LM head ``[D, vocab]`` (the token embedding's transpose when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.head[...]

    def _logits(self, h):
        return self._softcap(self.ln_f(h) @ self.head_weight())

    def _softcap(self, logits):
        """Float32 logits, soft-capped as ``model.final_softcap`` says (Gemma 2)."""
        logits, cap = logits.astype(jnp.float32), self.cfg.final_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> KVCache:
        """An empty key/value cache for ``batch`` sequences of up to ``length`` tokens."""
        cfg = self.cfg
        if cfg.kv_lora_rank:  # latent attention caches its latent
            return mla_cache(cfg.n_layers, batch, length, MLA.of(cfg), dtype)
        return KVCache.zeros(cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_width, dtype)

    def decode(self, tokens: jax.Array, cache: KVCache, start, *,
               pads: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Logits of ``tokens`` ``[B, T]`` at cache indices ``start``.., attending to the
        ``cache``'s earlier positions: a prompt (``start`` 0), then one token at a time.

        ``pads``: int ``[B]``, how many padding positions lead each row (prompts of different
        lengths, left-padded to one): row ``b``'s token at index ``i`` is at position
        ``max(i - pads[b], 0)`` and no query attends to its padding. None: no padding.
        """
        h, k = self._embed(tokens), self.cfg.first_k_dense
        if not k:
            h, cache = self.blocks.decode(h, cache, start, pads=pads)
            return self._logits(h), cache
        # the dense layers' share of the cache, then the mixture's
        h, first = self.dense_blocks.decode(h, KVCache(cache.k[:k], cache.v[:k]), start,
                                            pads=pads)
        h, rest = self.blocks.decode(h, KVCache(cache.k[k:], cache.v[k:]), start, pads=pads)
        return self._logits(h), KVCache(*(jnp.concatenate(pair) for pair in zip(
            first, rest, strict=True)))
