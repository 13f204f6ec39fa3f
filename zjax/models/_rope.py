"""Rotary position embeddings as Hugging Face computes them: ``rotate_half`` over each head,
unscaled or with Llama 3.1's, linear or YaRN's frequencies."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from zjax.models.config import LongRope, Yarn
from zjax.runtime.mesh import CONTEXT

__all__ = ["llama3_frequencies", "rotary", "yarn_frequencies"]


def rotary(x: jax.Array, theta: float, start: jax.Array | int = 0,
           scaling: tuple[float, float, float, int] | float | None = None,
           positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding of ``x`` ``[B, T, heads, head_dim]`` at positions
    ``start``..``start``+T-1, or at ``positions`` ``[B, T]`` (packed documents); ``scaling``
    is Llama 3.1's ``(factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)``, a number: linear scaling's factor (every frequency
    divided by it, Hugging Face's ``rope_type: linear``), :class:`~zjax.models.config.Yarn`
    (its frequencies, and cos and sin times its attention factor, as transformers applies
    it) or :class:`~zjax.models.config.LongRope` (Phi-3's, factors chosen by this call's
    longest position)."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    gain = 1.0
    if positions is None:
        positions = (start + jnp.arange(t, dtype=jnp.float32))[None]
    if isinstance(scaling, LongRope):  # the long factors once the call passes the original
        longest = _longest(positions) + 1
        factors = jnp.where(longest > scaling.original_max_len,
                            jnp.asarray(scaling.long, jnp.float32),
                            jnp.asarray(scaling.short, jnp.float32))
        inv_freq, gain = inv_freq / factors, scaling.attention_factor
    elif isinstance(scaling, Yarn):
        inv_freq, gain = yarn_frequencies(inv_freq, theta, scaling), scaling.attention_factor
    elif isinstance(scaling, tuple):
        inv_freq = llama3_frequencies(inv_freq, *scaling)
    elif scaling is not None:
        inv_freq = inv_freq / scaling
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B or 1, T, hd]
    # cos and sin stay [.., T, hd] and broadcast over heads at the multiply: a [.., T, 1, hd]
    # table would be padded on TPU (a minor dimension of 1 takes a whole tile)
    cos, sin = jnp.cos(angles)[:, :, None] * gain, jnp.sin(angles)[:, :, None] * gain
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., hd // 2:], x32[..., :hd // 2]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def llama3_frequencies(inv_freq: jax.Array, factor: float, low: float, high: float,
                       old_len: int) -> jax.Array:
    """Llama 3.1's scaling: wavelengths beyond ``old_len / low`` divided by ``factor``, below
    ``old_len / high`` kept, blended smoothly between (Hugging Face's ``rope_type: llama3``)."""
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, blended, scaled)


def yarn_frequencies(inv_freq: jax.Array, theta: float, y: Yarn) -> jax.Array:
    """YaRN's frequencies (transformers' ``_compute_yarn_parameters``): each dimension's
    blend of ``inv_freq`` (extrapolated) and ``inv_freq / factor`` (interpolated), by a ramp
    from the dimension that turns ``beta_fast`` times in ``original_max_len`` positions (kept)
    to the one that turns ``beta_slow`` times (interpolated)."""
    dim = 2 * inv_freq.shape[0]

    def dim_of(rotations: float) -> float:  # the dimension turning that often
        return dim * math.log(y.original_max_len / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dim_of(y.beta_fast), dim_of(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / y.factor * ramp + inv_freq * (1 - ramp)


def _longest(positions: jax.Array) -> jax.Array:
    """The call's longest position: over the whole sequence where a ``context`` axis splits
    it (inside a step's ``shard_map``), as transformers reads it from the full forward."""
    longest = jnp.max(positions)
    try:
        return lax.pmax(longest, CONTEXT)
    except NameError:  # no context axis bound
        return longest
