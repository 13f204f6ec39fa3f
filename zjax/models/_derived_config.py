"""What the Llama ``model`` section derives for the model (the mixture's settings, YaRN's
rotary scaling), importing nothing heavy."""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["LongRope", "MoESettings", "Yarn", "yarn_mscale"]


class MoESettings(NamedTuple):
    """What a mixture-of-experts layer and its loss read of the ``model`` section."""

    n_experts: int
    k: int
    renormalize: bool
    capacity_factor: float | None
    aux_loss_coef: float
    z_loss_coef: float
    matmul: str = "auto"
    exchange: str = "auto"
    chunks: int = 1
    sigmoid: bool = False
    groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    seq_aux_loss_coef: float = 0.0


class Yarn(NamedTuple):
    """YaRN's rotary scaling (Hugging Face's ``rope_type: yarn``), what
    :func:`zjax.models.llama.rotary` takes: frequencies blended between interpolated (divided
    by ``factor``) and kept by a ramp over the dimensions whose wavelengths fit between
    ``beta_fast`` and ``beta_slow`` rotations in ``original_max_len`` positions, and cos/sin
    multiplied by ``attention_factor``."""

    factor: float
    original_max_len: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class LongRope(NamedTuple):
    """Phi-3's ``longrope`` (transformers' ``_compute_longrope_parameters``): each frequency
    divided by its short factor, or by its long one when the call's longest position passes
    ``original_max_len`` (transformers picks per forward), cos and sin times
    ``attention_factor``."""

    short: tuple[float, ...]
    long: tuple[float, ...]
    original_max_len: int
    attention_factor: float

    @classmethod
    def of(cls, short, long, factor: float, original_max_len: int,
           attention_factor: float | None) -> LongRope:
        """The attention factor, where not given, as transformers derives it."""
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(
                1 + math.log(factor) / math.log(original_max_len))
        return cls(tuple(short), tuple(long), original_max_len, float(attention_factor))
