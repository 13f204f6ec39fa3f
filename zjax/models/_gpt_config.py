"""The reference GPT's ``model`` section (the built-in ``lm`` loop), importing nothing heavy."""

from __future__ import annotations

import dataclasses

from zjax.errors import ConfigError
from zjax.schema import choices, non_negative, positive, validate

__all__ = ["GPTConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the reference GPT (the ``model`` section of the built-in ``lm`` loop).

    Attributes:
      vocab_size: token ids 0..vocab_size-1 (256 for byte-level text).
      d_model: width of the residual stream.
      n_layers: transformer blocks (one ``Stack``).
      n_heads: attention heads (must divide ``d_model``; ``mesh.model`` must divide them).
      d_ff: MLP hidden width; empty for 4 x d_model (``mesh.model`` must divide it).
      max_seq_len: longest sequence (size of the learned position table).
      tie_embeddings: reuse the token embedding as the output projection.
      norm: ``rms`` (RMSNorm) or ``layer`` (LayerNorm with a bias, GPT-2's).
      norm_eps: the normalisation's epsilon (GPT-2: 1e-5).
      bias: biases on every projection (GPT-2's layout; the row-parallel ones are added once,
        after tensor parallelism's sum).
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
      remat: recompute each block in the backward pass instead of keeping its activations
        (ZeRO stages 0-2; the stage-3 schedule always keeps only the block inputs).
    """

    vocab_size: int = positive(256)
    d_model: int = positive(128)
    n_layers: int = positive(4)
    n_heads: int = positive(4)
    d_ff: int | None = positive(None, none_means="4 x d_model")
    max_seq_len: int = positive(256)
    tie_embeddings: bool = True
    norm: str = choices("rms", "layer", default="rms")
    norm_eps: float = positive(1e-6)
    bias: bool = False
    remat: bool = True
    attention: str = choices("auto", "dense", "blockwise", "splash", "triton", "cudnn",
                             default="auto")
    context_attention: str = choices("auto", "ulysses", "ring", default="auto")
    loss_chunk: int = positive(1024)
    mlp_chunk: int = non_negative(0)
    fp8: str = choices("none", "tensorwise", default="none")

    def __post_init__(self):
        validate(self, "model")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads: {self.n_heads} does not divide model.d_model {self.d_model}"
            )

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model
