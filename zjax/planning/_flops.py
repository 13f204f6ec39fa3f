"""Model FLOPs per token and the chips' bf16 peak: the figures of model FLOPs utilisation.

MFU (PaLM, appendix B) counts the FLOPs the model needs, not those the program runs: remat's
recomputation and ZeRO's collectives are not in it, so it compares setups fairly.
"""

from __future__ import annotations

__all__ = ["PEAK_BF16_FLOPS", "flops_per_token", "peak_flops"]

# dense bf16 peak per chip, FLOP/s, from the vendors' datasheets (GPUs: SXM, no sparsity).
# Keys are JAX's device_kind strings; "TPU v5" is v5p, "TPU v5 lite" v5e, "TPU v6 lite" v6e.
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989.4e12,
    "NVIDIA H200 141GB HBM3e": 989.4e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v6 lite": 918e12,
}


def peak_flops(device_kind: str) -> float | None:
    """The bf16 peak of one ``device_kind`` chip, or None when zjax does not know it."""
    return PEAK_BF16_FLOPS.get(device_kind)


def flops_per_token(n_params: int, *, n_layers: int | None = None, d_model: int | None = None,
                    seq_len: int | None = None, attn_width: int | None = None,
                    window: int | None = None, windowed_layers: int = 0,
                    inactive_params: int = 0, reference_forwards: int = 0) -> float:
    """Model FLOPs to train on one token: ``6 N`` (forward and backward of every parameter's
    matmul) plus, for a transformer whose shape is given, ``12 L H Q T`` for attention's
    scores and weighted sum over ``T`` positions (PaLM's; ``H Q`` is ``attn_width``, the
    query heads' total width, ``d_model`` unless given). ``windowed_layers`` of the layers
    attend through a sliding ``window`` and count ``min(T, window)`` positions.

    ``N`` counts every parameter a token uses, the embedding table included (for a tied
    embedding it is the output projection too): a mixture's ``inactive_params`` (the experts
    a token is not routed to) are left out. ``reference_forwards``: forward passes of a
    model of the same shape the step needs besides (a preference loss's reference): a third
    of the above each.
    """
    n_params = n_params - inactive_params
    scale = 1.0 + reference_forwards / 3.0
    if None in (n_layers, d_model, seq_len):
        return 6.0 * n_params * scale
    windowed = windowed_layers if window is not None else 0
    attended = (n_layers - windowed) * seq_len + windowed * min(seq_len, window or seq_len)
    return (6.0 * n_params + 12 * (attn_width or d_model) * attended) * scale
