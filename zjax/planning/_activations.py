"""Where a transformer step's activation memory goes, per device, estimated from its shape.

The compiled temp is the truth (``memory_analysis()``); it does not say what its buffers
hold. These estimates split the activations a decoder step keeps or works in by what they
are, from the model section's shape and the step's settings, so a plan shows which knob
moves which share:

- ``saved_inputs_bytes``: each layer's input, kept from the forward for the backward's
  recompute (``L x tokens x d_model`` in the gather dtype; every activation of every layer
  below stage 3 without ``model.remat``; over ``model`` with
  ``zero.partition_activations``; none on the device with ``zero.offload_activations``,
  where ``host_bytes`` holds them: exactly the compiled step's host temp).
- ``attention_bytes``: one layer's attention in its backward: queries, keys, values and
  output with their gradients, and the kernel's own workspace: dense attention's
  ``[heads, T, T]`` float32 scores and probabilities, or the fused kernels' per-row
  statistics.
- ``mlp_bytes``: one layer's MLP hidden units and their gradients (``tokens x d_ff``; a
  tile's with ``model.mlp_chunk``, where :func:`zjax.nn.mlp.choose_tiling` tiles).
- ``loss_bytes``: one chunk's ``[loss_chunk, vocab]`` float32 logits and their gradient,
  and the gradient of the final features.

Tokens are one micro-batch's on one device (``batch_size / data ranks / grad_accum`` sequences
of ``seq_len``); tensor parallelism divides the heads and the hidden units.
"""

from __future__ import annotations

import dataclasses

from zjax.nn.mlp import choose_tiling

__all__ = ["ActivationShape", "activation_bytes", "estimate", "kernel"]

_F32 = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """What the estimate reads: a decoder's shape and the step's activation settings."""

    layers: int
    d_model: int
    d_ff: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool  # a SwiGLU MLP (gate and up) rather than one up-projection
    sequences: int  # per device per micro-batch
    seq_len: int
    act_bytes: int  # the residual stream's dtype (the gather dtype)
    model: int = 1
    attention: str = "blockwise"  # the kernel that runs (``auto`` resolved)
    loss_chunk: int = 1024
    mlp_chunk: int = 0
    offload: bool = False
    partition: bool = False
    recompute: bool = True  # layers recomputed in the backward (stage 3, or remat)


def activation_bytes(s: ActivationShape) -> dict[str, int]:
    """The estimate's ``saved_inputs_bytes``, ``attention_bytes``, ``mlp_bytes``,
    ``loss_bytes`` and ``host_bytes`` (see the module docstring)."""
    tokens = s.sequences * s.seq_len
    heads, kv = max(1, s.heads // s.model), max(1, s.kv_heads // s.model)
    tensors = tokens * (2 * heads + 2 * kv) * s.head_dim * s.act_bytes  # q, k, v, out
    if s.attention == "dense":
        work = s.sequences * heads * s.seq_len * s.seq_len * _F32 * 2  # scores, probabilities
    else:
        work = tokens * heads * _F32 * 2  # log-sum-exp, the backward's row sums
    ff = s.d_ff // s.model
    _, pieces = choose_tiling(  # the tiling the model runs (none where it would hold more)
        tokens=tokens, d_model=s.d_model, d_ff=ff, chunk=s.mlp_chunk, act_bytes=s.act_bytes,
        weight_bytes=(3 if s.gated else 2) * s.d_model * ff * s.act_bytes, trainable=True)
    # gate, up, the gate's activation and their product (SwiGLU); the up-projection before
    # and after its activation (GELU); a tile's share
    hidden = -(-tokens * ff // pieces) * s.act_bytes * (4 if s.gated else 2)
    layer = tokens * s.d_model * s.act_bytes
    if not s.recompute:  # no remat: the backward reads every layer's own activations
        layer += tensors + work + tokens * (s.d_ff // s.model) * s.act_bytes * (
            4 if s.gated else 2)
    saved = s.layers * layer // (s.model if s.partition else 1)
    chunk = min(s.loss_chunk, tokens)
    return {
        "saved_inputs_bytes": 0 if s.offload else saved,
        "attention_bytes": 2 * tensors + work,
        "mlp_bytes": 2 * hidden,
        "loss_bytes": 2 * chunk * s.vocab * _F32 + tokens * s.d_model * _F32,
        "host_bytes": saved if s.offload else 0,
    }


def kernel(name: str, platform: str, *, seq_len: int, head_dim: int) -> str:
    """The attention kernel that runs for ``model.attention`` ``name`` on a device of
    ``platform`` (``auto`` resolved as :func:`zjax.nn.attention.choose` does for a causal,
    unpacked batch)."""
    if name != "auto":
        return name
    from zjax.nn.attention import Mask, choose, platform_kind

    mask = Mask(causal=True, window=None, softcap=None, scale=1.0, kv_len=None)
    return choose(platform_kind(platform), mask, q_len=seq_len, kv_len=seq_len,
                  head_dim=head_dim, segments=False)


def estimate(model, data, train, zero, *, n_batch: int, n_model: int, act_bytes: int,
             platform: str, n_context: int = 1) -> dict[str, int]:
    """:func:`activation_bytes` of a config's sections (the reference models' and any model
    section naming ``n_layers``, ``d_model``, ``n_heads`` and ``vocab_size``); ``{}`` when
    the model section does not describe a decoder. With ``n_context`` devices per sequence,
    each holds ``1 / n_context`` of its tokens (Ulysses' whole-length attention over
    ``1 / n_context`` of the heads holds as much)."""
    names = ("n_layers", "d_model", "n_heads", "vocab_size")
    if not all(hasattr(model, k) for k in names):
        return {}
    head_dim = getattr(model, "head_width", None) or model.d_model // model.n_heads
    shape = ActivationShape(
        layers=model.n_layers, d_model=model.d_model,
        d_ff=getattr(model, "ff", 4 * model.d_model), heads=model.n_heads,
        kv_heads=getattr(model, "kv_heads", model.n_heads), head_dim=head_dim,
        vocab=model.vocab_size, gated=hasattr(model, "n_kv_heads"),
        sequences=max(1, data.batch_size // n_batch // train.grad_accum),
        seq_len=max(1, data.seq_len // n_context), act_bytes=act_bytes, model=n_model,
        attention=kernel(getattr(model, "attention", "dense"), platform,
                         seq_len=data.seq_len, head_dim=head_dim),
        loss_chunk=getattr(model, "loss_chunk", data.seq_len * data.batch_size),
        mlp_chunk=getattr(model, "mlp_chunk", 0),
        offload=zero.offload_activations, partition=zero.partition_activations,
        recompute=zero.stage == 3 or getattr(model, "remat", True))
    return activation_bytes(shape)
