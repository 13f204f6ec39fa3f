"""A layer scan with per-layer recompute whose saved inputs live where ZeRO-R puts them (host
memory, or split over the tensor-parallel axis): a ``Stack``'s runner at stages 0-2, whose
params are whole on every device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zjax.partition._layer_io import cotangent, float_or_none, input_keeping, is_float, refill

__all__ = ["kept_scan"]


def kept_scan(
    layer_fn: Callable[..., Any],
    stacked_params: Any,
    x: Any,
    *,
    offload: bool = False,
    partition_axis: str | None = None,
    context: Any = None,
    index: jax.Array | None = None,
) -> Any:
    """``x`` through L layers, each recomputed in the backward from its kept input.

    ``lax.scan`` over ``jax.checkpoint(layer_fn)``, except that the one activation kept per
    layer (its input) is stored as ZeRO-R stores it: in ``pinned_host`` memory with
    ``offload`` (DeepSpeed's ``cpu_checkpointing``), each device's ``1/n`` slice with
    ``partition_axis`` (``partition_activations``: inside ``shard_map``, the inputs
    replicated over that axis, as tensor parallelism leaves them).

    Args:
      layer_fn: ``layer_fn(params_i, h)``, or ``layer_fn(params_i, h, context)`` when
        ``context`` is given; returns the next ``h``. Pure.
      stacked_params: pytree of whole params with leading layer dimension L.
      x: the activations entering layer 0.
      offload: keep saved inputs in host memory.
      partition_axis: the mesh axis to split saved inputs over (None: keep them whole).
      context: values every layer reads (segment ids, positions); gradients summed.
      index: ``[L]`` per-layer ints (a ``Stack``'s layer indices), passed to layer ``i`` as
        ``index=index[i]``; None: not passed.

    Returns:
      The output of layer L-1.
    """
    keep, restore = input_keeping(partition_axis, offload=offload)
    avals = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)), x)

    def apply(p, h, c, i):
        args = () if context is None else (c,)
        return layer_fn(p, h, *args) if i is None else layer_fn(p, h, *args, index=i)

    def forward(params, h, c, idx, *, save: bool):
        def step(h, layer):
            p, i = layer
            return apply(p, h, c, i), (keep(h) if save else None)

        return lax.scan(step, h, (params, idx))

    @jax.custom_vjp
    def run(params, h, c, idx):
        return forward(params, h, c, idx, save=False)[0]

    def run_fwd(params, h, c, idx):
        out, kept = forward(params, h, c, idx, save=True)
        return out, (params, c, kept, idx)

    def run_bwd(res, dy):
        params, c, kept, idx = res
        float_c = [is_float(v) for v in jax.tree.leaves(c)]

        def step(carry, layer):
            dy, dc = carry
            p, kept_i, i = layer
            out, vjp = jax.vjp(lambda p_, h_, c_: apply(p_, h_, c_, i), p,
                               restore(kept_i, avals), c)
            dp, dh, dc_i = vjp(jax.tree.map(cotangent, out, dy))
            dc_i = [d for d, f in zip(jax.tree.leaves(dc_i), float_c, strict=True) if f]
            return (dh, [a + b for a, b in zip(dc, dc_i, strict=True)]), dp

        dc0 = [jnp.zeros(np.shape(v), jnp.result_type(v))
               for v, f in zip(jax.tree.leaves(c), float_c, strict=True) if f]
        dy = jax.tree.map(cotangent, avals, dy)
        (dx, dc), dparams = lax.scan(step, (dy, dc0), (params, kept, idx), reverse=True)
        return dparams, jax.tree.map(float_or_none, dx, avals), refill(c, dc), None

    run.defvjp(run_fwd, run_bwd)
    return run(stacked_params, x, () if context is None else context, index)
