"""The reference models' ``model`` config sections (``GPTConfig`` for the built-in ``lm``
loop, ``LlamaConfig`` for ``llama``), in a module that imports nothing heavy (no Flax): a config
is read and validated without loading the model."""

from __future__ import annotations

import dataclasses

from zjax.errors import ConfigError
from zjax.models._derived_config import LongRope, MoESettings, Yarn, yarn_mscale
from zjax.models._gpt_config import GPTConfig
from zjax.models._options_config import check_groups, check_longrope, check_mla, check_mtp
from zjax.schema import choices, non_negative, positive, validate

__all__ = ["GPTConfig", "LlamaConfig", "LongRope", "MoESettings", "Yarn"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (Llama 2/3 layout).

    Attributes:
      vocab_size: token ids 0..vocab_size-1 (256 for byte-level text).
      d_model: width of the residual stream (Hugging Face's ``hidden_size``).
      n_layers: decoder layers (one ``Stack``).
      n_heads: query heads (``mesh.model`` must divide them; with no ``head_dim``, they must
        divide ``d_model``).
      n_kv_heads: key/value heads, grouped-query attention (must divide ``n_heads``;
        ``mesh.model`` must divide them); empty for ``n_heads`` (multi-head attention).
      head_dim: width of one attention head; empty for ``d_model / n_heads`` (Qwen3 and
        Gemma set it: their ``n_heads x head_dim`` need not be ``d_model``).
      qkv_bias: biases on the query, key and value projections (Qwen2/2.5), none on the
        output one.
      qk_norm: RMSNorm over each query and key head before rotary (Qwen3's ``q_norm`` and
        ``k_norm``, one ``[head_dim]`` scale each, shared by the heads).
      sliding_window: each query attends to the ``sliding_window`` positions ending at its own
        (Mistral's); empty for full causal attention.
      global_every: with ``sliding_window``: every ``global_every``-th layer (layer ``i`` with
        ``(i + 1) % global_every == 0``) attends globally, the others through the window
        (Gemma 2: 2, Gemma 3: 6); empty: every layer windowed.
      local_rope_theta: the windowed layers' rotary base, unscaled (Gemma 3's
        ``rope_local_base_freq``); empty: theirs is every layer's (``rope_theta``, scaled).
      attn_softcap: attention scores become ``c * tanh(score / c)`` before the mask (Gemma 2's
        ``attn_logit_softcapping``); empty: none.
      final_softcap: the logits become ``c * tanh(logit / c)`` (Gemma 2's
        ``final_logit_softcapping``), in the loss and in sampling; empty: none.
      query_pre_attn_scalar: scores are scaled by its inverse square root instead of the head
        width's (Gemma 2/3's ``query_pre_attn_scalar``); empty: ``head_dim``.
      kv_lora_rank: DeepSeek's multi-head latent attention (MLA) where > 0: keys and values
        come up from a ``kv_lora_rank``-wide latent (normalised), each head's key a
        ``qk_nope_head_dim`` part from it and a ``qk_rope_head_dim`` rotary part shared by
        the heads, values ``v_head_dim`` wide; 0: standard attention.
      q_lora_rank: MLA's queries through a normalised latent this wide; empty: one
        projection.
      qk_nope_head_dim: MLA's query/key head width from the latent (no rotary).
      qk_rope_head_dim: MLA's rotary query/key width (the key's shared by the heads).
      v_head_dim: MLA's value head width.
      rope_interleave: MLA's rotary part de-interleaved before rotating (transformers'
        ``rope_interleave``, DeepSeek's checkpoints).
      mtp_layers: DeepSeek-V3's multi-token prediction: 1 adds a module (the hidden state and
        the next token's embedding, each normalised, projected, one more layer, the shared
        head) that predicts the token after next; its cross-entropy is an extra loss.
      mtp_loss_coef: that loss's weight (DeepSeek-V3's lambda: 0.3, later 0.1); reported as
        ``mtp_loss``.
      post_norms: an RMSNorm on the attention's and on the MLP's output before each residual
        add (Gemma 2/3's ``post_attention_layernorm`` and ``post_feedforward_layernorm``).
      mlp_activation: the gated MLP's activation: ``silu`` (SwiGLU, Llama's), ``gelu_tanh``
        (GeGLU with tanh GELU, Gemma's ``gelu_pytorch_tanh``) or ``gelu`` (exact GELU).
      norm_plus_one: every RMSNorm scales by ``1 + weight`` (Gemma's; the weight starts at 0).
      embed_scale: the token embeddings are multiplied by sqrt(d_model) in the activation
        dtype (Gemma's).
      d_ff: gated MLP hidden width (``intermediate_size``); empty for Llama 2's rule: 8/3 x
        d_model rounded up to a multiple of 256 (11008 at d_model 4096; ``mesh.model`` must
        divide it).
      max_seq_len: longest sequence (rotary positions have no table; this bounds the data).
      rope_theta: rotary embedding base (10000 in Llama 2, 500000 in Llama 3).
      norm_eps: RMSNorm epsilon (``rms_norm_eps``).
      rope_scaling: empty, ``llama3``: Llama 3.1's frequency-dependent scaling of the
        rotary frequencies for long contexts (long wavelengths divided by ``rope_factor``,
        short ones kept, a smooth blend between), as Hugging Face's ``rope_type: llama3``;
        ``linear``: every frequency divided by ``rope_factor`` (Gemma 3's global layers); or
        ``yarn`` (:class:`Yarn`: Qwen's and DeepSeek's long context).
      rope_factor: ``llama3``: the long wavelengths' division (``factor``; 8 in Llama 3.1,
        32 in Llama 3.2); ``linear``: every frequency's; ``yarn``: the interpolation's.
      rope_low_freq_factor: ``llama3``: ``low_freq_factor``.
      rope_high_freq_factor: ``llama3``: ``high_freq_factor`` (> ``rope_low_freq_factor``).
      rope_original_max_len: ``llama3`` and ``yarn``: ``original_max_position_embeddings``
        (8192).
      rope_beta_fast: ``yarn``: the ramp's start, in rotations over the original length:
        dimensions turning more often keep their frequency (``beta_fast``, 32).
      rope_beta_slow: ``yarn``: the ramp's end: dimensions turning less often are
        interpolated (``beta_slow``, 1).
      rope_mscale: ``yarn``: DeepSeek's ``mscale`` (0: unset); with ``rope_mscale_all_dim``
        too, the attention factor is ``m(rope_mscale) / m(rope_mscale_all_dim)``, where
        ``m(s) = 0.1 s ln(factor) + 1``; else ``0.1 ln(factor) + 1``.
      rope_mscale_all_dim: ``yarn``: DeepSeek's ``mscale_all_dim`` (0: unset).
      rope_attention_factor: ``yarn``: ``attention_factor`` given outright (empty: derived).
      rope_truncate: ``yarn``: round the ramp's bounds to whole dimensions (``truncate``).
      rope_short_factor: ``longrope`` (Phi-3's): a divisor per rotary frequency; attention
        factor from ``rope_factor`` (``max_position_embeddings / original_...``).
      rope_long_factor: ``longrope``: the divisors once a call passes ``rope_original_max_len``.
      tie_embeddings: reuse the token embedding as the output projection (untied in Llama).
      attention: the attention kernel (:func:`zjax.nn.attention`): ``auto`` picks per
        backend (splash on TPU, Pallas Triton on GPU, dense for short and blockwise for long
        sequences elsewhere); ``dense``, ``blockwise``, ``splash``, ``triton``, ``cudnn`` force
        one (refused where it cannot honour the mask).
      context_attention: how attention runs when ``mesh.context`` splits the sequence:
        ``ulysses`` (all-to-all to head-split full-length attention in the ``attention``
        kernel; the heads per ``mesh.model`` device must divide by ``mesh.context``, key/value
        heads are repeated up to it), ``ring`` (key/value blocks passed around the axis; any
        heads), ``auto`` (Ulysses where the heads split, else the ring).
      loss_chunk: tokens per chunk of the cross-entropy: the loss holds one chunk's
        ``[loss_chunk, vocab]`` float32 logits, not every token's (where a device has few
        tokens next to the vocabulary, the backward takes slices of the vocabulary holding
        as many: :mod:`zjax.nn.loss`).
      mlp_chunk: tokens per chunk of each layer's MLP (ALST's TiledMLP,
        :func:`zjax.nn.tiled`): the backward holds one chunk's ``[mlp_chunk, d_ff]`` hidden
        units instead of every token's, for one more MLP forward; 0 (default) runs it whole.
        Where the weights train and a device's tokens are few next to them, the hidden units
        are sliced instead (as many at a time; :func:`zjax.nn.mlp.tiled_hidden`), and where
        neither would hold less than the whole MLP it runs whole
        (:func:`zjax.nn.mlp.choose_tiling`).
      fp8: ``none`` (default) or ``tensorwise``: every linear projection of the decoder
        layers (attention's q/k/v/o, the MLP's) runs as FP8 GEMMs (:func:`zjax.nn.fp8_matmul`:
        inputs and weights in ``float8_e4m3fn``, the output's gradient in ``float8_e5m2``,
        each scaled by its current absolute maximum over the whole tensor, float32
        accumulation); embeddings, the LM head, norms, the router, attention's own products
        and a mixture's experts stay in ``zero.gather_dtype``. Hopper GPUs run it as FP8
        GEMMs; TPUs have no FP8 matrix unit (refused).
      remat: recompute each layer in the backward pass (ZeRO stages 0-2; the stage-3 schedule
        always keeps only the layer inputs).
      n_experts: routed experts in every layer's MLP (a mixture of experts, Mixtral's and
        Qwen3-MoE's layout, :mod:`zjax.nn.moe`); 0 (default): a dense MLP.
      experts_per_token: experts each token is routed to (top-k; at most ``n_experts``).
      n_shared_experts: experts every token goes through besides its routed ones (DeepSeek's;
        one gated MLP ``n_shared_experts x moe_d_ff`` wide).
      moe_d_ff: one expert's hidden width (Qwen3-MoE's ``moe_intermediate_size``); empty:
        ``d_ff`` (Mixtral's ``intermediate_size``).
      router_renormalize: the kept router probabilities are divided by their sum (Mixtral;
        Qwen3-MoE's ``norm_topk_prob``).
      router_aux_loss_coef: the load-balancing loss's weight in the loss (Switch
        Transformer's, as Hugging Face scales it: 1 x top-k when balanced; averaged over the
        layers); reported as ``moe_aux_loss``.
      router_z_loss_coef: the router z-loss's weight (ST-MoE: the mean squared log-sum-exp
        of the router logits); reported as ``moe_z_loss``.
      capacity_factor: empty (default): dropless, every token-expert assignment computed
        (grouped matmuls); a number: each expert takes at most ``capacity_factor x tokens x
        top-k / n_experts`` of a device's assignments per layer, first choices first
        (GShard), the rest dropped and counted in ``moe_dropped_tokens``.
      moe_matmul: the dropless experts' grouped matmul: ``auto`` (``ragged_dot`` on TPU,
        ``tiled`` elsewhere), ``ragged_dot`` (``lax.ragged_dot``: native on TPU, a dense
        expansion on XLA:CPU and XLA:GPU) or ``tiled`` (each expert's rows in whole tiles,
        one tile's matmuls at a time: memory of one tile, at most one tile of padding per
        expert).
      moe_exchange: how dropless assignments travel under expert parallelism (only the routed
        rows): ``auto`` (``chunked`` on XLA:CPU, ``ragged`` elsewhere), ``ragged``
        (``ragged_all_to_all``: XLA:GPU and TPU) or ``chunked`` (rounds of fixed-size
        all-to-alls, as many as the largest slice needs: any backend).
      first_k_dense: with experts, the first this many layers keep a dense MLP ``d_ff`` wide
        (DeepSeek's ``first_k_dense_replace``; a stack of their own).
      router_score: ``softmax`` (Mixtral, Qwen-MoE) or ``sigmoid`` (DeepSeek-V3: sigmoid
        scores, a per-expert selection bias ``router_bias`` in each layer, group-limited
        top-k; ``scoring_func``).
      router_groups: DeepSeek's expert groups (``n_group``): a token chooses among the
        ``router_topk_groups`` best groups' experts (V3: groups scored by their two best
        biased sigmoid scores; V2's softmax ``group_limited_greedy``: by their best).
      router_topk_groups: the groups a token may choose from (``topk_group``).
      routed_scaling_factor: the routed experts' output times this (DeepSeek-V3's).
      router_bias_update_speed: DeepSeek-V3's auxiliary-loss-free balancing: each step every
        layer's ``router_bias`` moves by this much against its expert's load error (down if
        overloaded, up if idle; not by gradients); 0 keeps the bias as loaded.
      router_seq_aux_loss_coef: the weight of DeepSeek-V3's sequence-wise balance loss
        (``sum_e f_e P_e`` per sequence over normalised scores, averaged over the sequences
        and the mixture's layers; DeepSeek-V3 used 0.0001); reported as ``moe_seq_aux_loss``.
      moe_chunks: dropless expert parallelism's tokens split into this many independent
        exchanges, so one chunk's all-to-all runs while another's experts compute (the same
        bytes, worst-case buffers 1 / N as large); 1: one exchange.
    """

    vocab_size: int = positive(256)
    d_model: int = positive(128)
    n_layers: int = positive(4)
    n_heads: int = positive(4)
    n_kv_heads: int | None = positive(None, none_means="n_heads")
    head_dim: int | None = positive(None, none_means="d_model / n_heads")
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = positive(None, none_means="full causal attention")
    global_every: int | None = positive(None, none_means="every layer alike")
    local_rope_theta: float | None = positive(None, none_means="rope_theta")
    attn_softcap: float | None = positive(None, none_means="none")
    final_softcap: float | None = positive(None, none_means="none")
    query_pre_attn_scalar: float | None = positive(None, none_means="head_dim")
    post_norms: bool = False
    kv_lora_rank: int = non_negative(0)
    q_lora_rank: int | None = positive(None, none_means="one query projection")
    qk_nope_head_dim: int = positive(128)
    qk_rope_head_dim: int = positive(64)
    v_head_dim: int = positive(128)
    rope_interleave: bool = True
    mtp_layers: int = non_negative(0)
    mtp_loss_coef: float = non_negative(0.3)
    mlp_activation: str = choices("silu", "gelu_tanh", "gelu", default="silu")
    norm_plus_one: bool = False
    embed_scale: bool = False
    d_ff: int | None = positive(None, none_means="8/3 x d_model, rounded up to 256")
    max_seq_len: int = positive(256)
    rope_theta: float = positive(10000.0)
    rope_scaling: str | None = None
    rope_factor: float = positive(8.0)
    rope_low_freq_factor: float = positive(1.0)
    rope_high_freq_factor: float = positive(4.0)
    rope_original_max_len: int = positive(8192)
    rope_beta_fast: float = positive(32.0)
    rope_beta_slow: float = positive(1.0)
    rope_mscale: float = non_negative(0.0)
    rope_mscale_all_dim: float = non_negative(0.0)
    rope_attention_factor: float | None = positive(None, none_means="derived from the factor")
    rope_truncate: bool = True
    rope_short_factor: list | None = None
    rope_long_factor: list | None = None
    norm_eps: float = positive(1e-5)
    tie_embeddings: bool = False
    remat: bool = True
    attention: str = choices("auto", "dense", "blockwise", "splash", "triton", "cudnn",
                             default="auto")
    context_attention: str = choices("auto", "ulysses", "ring", default="auto")
    loss_chunk: int = positive(1024)
    mlp_chunk: int = non_negative(0)
    fp8: str = choices("none", "tensorwise", default="none")
    n_experts: int = non_negative(0)
    experts_per_token: int = positive(2)
    n_shared_experts: int = non_negative(0)
    first_k_dense: int = non_negative(0)
    moe_d_ff: int | None = positive(None, none_means="d_ff")
    router_renormalize: bool = True
    router_aux_loss_coef: float = non_negative(0.001)
    router_z_loss_coef: float = non_negative(0.0)
    capacity_factor: float | None = positive(None, none_means="dropless")
    moe_matmul: str = choices("auto", "ragged_dot", "tiled", default="auto")
    moe_exchange: str = choices("auto", "ragged", "chunked", default="auto")
    moe_chunks: int = positive(1)
    router_score: str = choices("softmax", "sigmoid", default="softmax")
    router_groups: int = positive(1)
    router_topk_groups: int = positive(1)
    routed_scaling_factor: float = positive(1.0)
    router_bias_update_speed: float = non_negative(0.0)
    router_seq_aux_loss_coef: float = non_negative(0.0)

    def __post_init__(self):
        validate(self, "model")
        self._check_experts()
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads: {self.n_heads} does not divide model.d_model "
                              f"{self.d_model} (or set model.head_dim)")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"model.n_kv_heads: {self.kv_heads} does not divide "
                              f"model.n_heads {self.n_heads} (grouped-query attention)")
        if self.rope_scaling not in (None, "llama3", "linear", "yarn", "longrope"):
            raise ConfigError(f"model.rope_scaling: {self.rope_scaling!r} is not supported; "
                              "choose llama3 (Llama 3.1's), linear, yarn, longrope or leave it "
                              "empty")
        check_longrope(self)
        for key in ("global_every", "local_rope_theta"):
            if getattr(self, key) is not None and self.sliding_window is None:
                raise ConfigError(f"model.{key}: {getattr(self, key)} needs "
                                  "model.sliding_window (it sets the windowed layers apart)")
        if (self.rope_scaling == "llama3"
                and self.rope_high_freq_factor <= self.rope_low_freq_factor):
            raise ConfigError(f"model.rope_high_freq_factor: {self.rope_high_freq_factor} must "
                              f"exceed model.rope_low_freq_factor {self.rope_low_freq_factor}")
        check_mla(self)
        check_mtp(self)
        if self.head_width % 2 and not self.kv_lora_rank:
            key, what = (("model.head_dim", "") if self.head_dim else
                         ("model.n_heads", " (d_model / n_heads)"))
            raise ConfigError(f"{key}: a head of {self.head_width} dimensions{what} is odd; "
                              "rotary embeddings rotate pairs")

    def _check_experts(self):
        if not self.n_experts:
            for key in ("n_shared_experts", "first_k_dense"):
                if getattr(self, key):
                    raise ConfigError(f"model.{key}: {getattr(self, key)} needs "
                                      "model.n_experts (a mixture of experts)")
            return
        if self.experts_per_token > self.n_experts:
            raise ConfigError(f"model.experts_per_token: {self.experts_per_token} exceeds "
                              f"model.n_experts {self.n_experts}; route each token to at most "
                              "every expert")
        check_groups(self)
        if self.first_k_dense >= self.n_layers or (self.first_k_dense and self.global_every):
            raise ConfigError(f"model.first_k_dense: {self.first_k_dense} must leave a mixture "
                              f"layer of model.n_layers {self.n_layers} (and takes no "
                              "global_every)")
        if self.mlp_chunk:
            raise ConfigError(f"model.mlp_chunk: {self.mlp_chunk} tiles a dense MLP; with "
                              f"model.n_experts {self.n_experts} the experts run on grouped "
                              "matmuls; set it to 0")

    def dense_part(self) -> LlamaConfig:
        """The config of the first ``first_k_dense`` layers: no experts."""
        return dataclasses.replace(self, n_experts=0, n_shared_experts=0, first_k_dense=0,
                                   router_score="softmax", router_groups=1,
                                   router_topk_groups=1)

    @property
    def moe(self) -> MoESettings | None:
        """The mixture's settings; None for a dense MLP."""
        if not self.n_experts:
            return None
        return MoESettings(self.n_experts, self.experts_per_token, self.router_renormalize,
                           self.capacity_factor, self.router_aux_loss_coef,
                           self.router_z_loss_coef, self.moe_matmul, self.moe_exchange,
                           self.moe_chunks, self.router_score == "sigmoid", self.router_groups,
                           self.router_topk_groups, self.routed_scaling_factor,
                           self.router_seq_aux_loss_coef)

    @property
    def expert_ff(self) -> int:
        """One expert's hidden width: ``moe_d_ff``, or ``ff``."""
        return self.moe_d_ff or self.ff

    @property
    def rope(self) -> tuple:
        """``(theta, scaling)``: what :func:`zjax.models.llama.rotary` takes (scaling: None,
        llama3's 4-tuple, linear's factor or :class:`Yarn`)."""
        if self.rope_scaling == "yarn":
            return self.rope_theta, self._yarn()
        if self.rope_scaling == "longrope":
            return self.rope_theta, LongRope.of(self.rope_short_factor, self.rope_long_factor,
                                                self.rope_factor, self.rope_original_max_len,
                                                self.rope_attention_factor)
        scaling = {"llama3": (self.rope_factor, self.rope_low_freq_factor,
                              self.rope_high_freq_factor, self.rope_original_max_len),
                   "linear": self.rope_factor}.get(self.rope_scaling)
        return self.rope_theta, scaling

    def _yarn(self) -> Yarn:
        """:class:`Yarn` of the ``rope_*`` keys, the attention factor derived as
        transformers' ``_compute_yarn_parameters`` derives it."""
        factor, attention = self.rope_factor, self.rope_attention_factor
        if attention is None:
            attention = (yarn_mscale(factor, self.rope_mscale)
                         / yarn_mscale(factor, self.rope_mscale_all_dim)
                         if self.rope_mscale and self.rope_mscale_all_dim
                         else yarn_mscale(factor))
        return Yarn(factor, self.rope_original_max_len, self.rope_beta_fast,
                    self.rope_beta_slow, float(attention), self.rope_truncate)

    @property
    def local_rope(self) -> tuple:
        """``rope`` of the windowed layers (``local_rope_theta``, unscaled, where set)."""
        return self.rope if self.local_rope_theta is None else (self.local_rope_theta, None)

    def windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through ``sliding_window``."""
        if self.sliding_window is None:
            return False
        return self.global_every is None or (layer + 1) % self.global_every != 0

    @property
    def kv_heads(self) -> int:
        """Key/value heads (latent attention: one per query head)."""
        return self.n_heads if self.kv_lora_rank else self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """One head's width: ``head_dim``, or ``d_model / n_heads``; latent attention's query
        and key heads: ``qk_nope_head_dim + qk_rope_head_dim``."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ff(self) -> int:
        if self.d_ff:
            return self.d_ff
        hidden = 8 * self.d_model // 3
        return (hidden + 255) // 256 * 256
