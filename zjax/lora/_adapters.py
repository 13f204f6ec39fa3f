"""Low-rank adapters on a model's linear layers: their params and their matmul.

A weight ``w`` ``[in, out]`` (zjax stores PyTorch's transpose) gets ``w_lora_a`` ``[in, r]``
and ``w_lora_b`` ``[r, out]`` (a module that fuses ``k`` weights of one input, GPT-2's
``c_attn``, gets one pair named after it: ``a`` ``[in, r]`` and ``b`` ``[r, k, out]``, part
``j`` of ``b`` updating weight ``j``: PEFT's adapter on the fused module), initialised as
PEFT does (A Kaiming-uniform, B zeros: the adapted model starts as the base exactly), and is
applied as
``y @ w + scale * (y @ a) @ b``. The two thin matmuls replace the weight gradient: the base
``w`` is frozen (no gradient, no optimizer state).

Tensor parallelism: a column-parallel weight (split on ``out``) has its ``b`` split the same
way and ``a`` whole on every device; a row-parallel one (split on ``in``) has ``a`` split and
``b`` whole. The whole factor meets only this device's part of the product, so its gradient
is summed over ``model`` (it enters as a column-parallel input).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zjax.lora.config import LoraConfig
from zjax.nn import column_parallel_input

__all__ = ["ADAPTER_SUFFIXES", "adapter_pair", "is_adapter", "lora_matmul", "merged_weight"]


ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


def is_adapter(path: str) -> bool:
    """Whether the leaf at ``path`` (``/``-joined) is an adapter factor."""
    return path.rsplit("/", 1)[-1].endswith(ADAPTER_SUFFIXES)


def adapter_pair(rngs: nnx.Rngs, d_in: int, d_out: int, lora: LoraConfig,
                 axes: tuple[str | None, ...], *, parts: int = 0, experts: int = 0
                 ) -> tuple[nnx.Param, nnx.Param]:
    """``(a [in, r], b [r, out])`` for a weight ``[in, out]`` whose dimensions are named
    ``axes`` (``b [r, parts, out]`` for a module fusing ``parts`` weights; a mixture's
    experts' weight ``[E, in, out]``, ``axes`` naming its three dimensions, gets
    ``[E, in, r]`` and ``[E, r, out]``): a uniform in ``±1/sqrt(in)`` (PyTorch's
    ``kaiming_uniform_(a=sqrt(5))``, PEFT's default), b zeros."""
    bound = 1.0 / math.sqrt(d_in)
    lead, lead_axes = ((experts,), axes[:1]) if experts else ((), ())
    d_in_axis, d_out_axis = axes[-2:]
    a = jax.random.uniform(rngs.params(), (*lead, d_in, lora.rank), jnp.float32, -bound, bound)
    shape, names = ((lora.rank, parts, d_out), (None, None, d_out_axis)) if parts \
        else ((*lead, lora.rank, d_out), (*lead_axes, None, d_out_axis))
    return (nnx.Param(a, out_sharding=(*lead_axes, d_in_axis, None), eager_sharding=False),
            nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=names, eager_sharding=False))


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float, *,
                  row_parallel: bool = False) -> jax.Array:
    """``w + scale * a @ b`` in ``w``'s dtype: a weight with its adapters' update merged in
    (a mixture's experts: ``[E, in, out]`` with ``[E, in, r]`` and ``[E, r, out]``), for a
    layer that cannot split its input's matmul (the experts' grouped matmuls). The update's
    gradient reaches ``a`` and ``b``; under tensor parallelism the whole factor (``a`` of a
    column-parallel weight, ``b`` of a row-parallel one) enters as a column-parallel input."""
    if row_parallel:
        b = column_parallel_input(b)
    else:
        a = column_parallel_input(a)
    # in the weight's (gathered) dtype: a float32 update would be twice the experts' bytes
    update = jnp.matmul(a.astype(w.dtype), b.astype(w.dtype))
    return w + update * jnp.asarray(scale, w.dtype)


def lora_matmul(y: jax.Array, w: jax.Array, a: jax.Array | None, b: jax.Array | None,
                scale: float, *, row_parallel: bool = False,
                adapter_input: jax.Array | None = None) -> jax.Array:
    """``y @ w``, plus ``scale * (x @ a) @ b`` where the weight has adapters, ``x`` being
    ``adapter_input`` (``y`` after dropout) or ``y``.

    ``row_parallel``: ``w`` is split on its input (an output projection), so ``y @ w`` is a
    partial sum the caller reduces; the update is one too, and ``b`` is the whole factor.
    """
    out = y @ w
    if a is None:
        return out
    if row_parallel:
        b = column_parallel_input(b)
    else:
        a = column_parallel_input(a)
    x = y if adapter_input is None else adapter_input
    update = (x @ a.astype(y.dtype)) @ b.astype(y.dtype)
    return out + (update * jnp.asarray(scale, update.dtype)).astype(out.dtype)
