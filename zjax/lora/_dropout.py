"""Dropout on the adapters' input (PEFT's ``lora_dropout``), drawn from keys the batch carries.

The step gives every row of the global batch its own key (``dropout_keys``, from
``train.seed``, the step and the row's index: :func:`row_keys`), so a row's masks do not
depend on how many devices share the batch or on micro-batching, and a resumed run draws
the masks it would have drawn. A block folds in its layer and the adapted module; a device
holding part of a row's features (a row-parallel projection's inputs under tensor
parallelism) or of its tokens (sequence parallelism) folds in its place too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zjax.nn import model_axis_size
from zjax.runtime.mesh import CONTEXT, MODEL

__all__ = ["AdapterDropout", "row_keys"]


def row_keys(seed: int, step: jax.Array, rows: int) -> jax.Array:
    """uint32 key data ``[rows, 2]``: row ``i``'s key at optimizer step ``step``."""
    base = jax.random.fold_in(jax.random.key(seed), step)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(rows, dtype=jnp.uint32))
    return jax.random.key_data(keys)


class AdapterDropout(NamedTuple):
    """One layer's dropout on its adapters' inputs.

    Attributes:
      rate: the probability of zeroing an input; kept ones are scaled by ``1 / (1 - rate)``.
      keys: uint32 key data ``[B, 2]``, one per row of the local batch.
      layer: the layer's index (an int32 scalar, traced in a layer scan).
    """

    rate: float
    keys: jax.Array
    layer: jax.Array | int

    def __call__(self, y: jax.Array, module: int, *, row_parallel: bool = False) -> jax.Array:
        """``y`` ``[B, ..., D]`` with dropout, the mask drawn for adapted ``module``."""
        salt = [self.layer, module]
        if row_parallel and model_axis_size() > 1:  # this device's slice of the inputs
            salt.append(lax.axis_index(MODEL))
        if model_axis_size(CONTEXT) > 1:  # this device's part of each sequence
            salt.append(lax.axis_index(CONTEXT))
        keep_p = 1.0 - self.rate

        def row(key, x):
            key = jax.random.wrap_key_data(key)
            for s in salt:
                key = jax.random.fold_in(key, s)
            keep = jax.random.bernoulli(key, keep_p, x.shape)
            return jnp.where(keep, x * jnp.asarray(1.0 / keep_p, x.dtype), jnp.zeros((), x.dtype))

        return jax.vmap(row)(self.keys, y)
