"""A model trained through its adapters: every other leaf frozen, stored in the base dtype."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zjax.errors import ConfigError
from zjax.lora import LoraConfig, is_adapter
from zjax.models.trainable import Trainable
from zjax.partition.plan import path_str

__all__ = ["with_adapters"]


def with_adapters(trainable: Trainable, lora: LoraConfig) -> Trainable:
    """``trainable`` (a model built with ``lora``'s adapters) with only its adapters trained:
    the base is frozen, its float leaves stored (and gathered) in ``lora.base_dtype``."""
    dtype = jnp.dtype(lora.base_dtype)

    def base(path, x):
        keep = is_adapter(path_str(path)) or not jnp.issubdtype(x.dtype, jnp.floating)
        return x if keep else x.astype(dtype)

    def init(rng):
        return jax.tree_util.tree_map_with_path(base, trainable.init(rng))

    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(trainable.init, jax.random.key(0)))[0]]
    if not any(map(is_adapter, paths)):
        raise ConfigError(f"lora.targets: {lora.targets!r} matches no linear layer of this "
                          "model: nothing would be trained")
    return dataclasses.replace(trainable, init=init, frozen=lambda path: not is_adapter(path))
