"""A model trained through its adapters: every other leaf frozen, stored in the base dtype."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zjax.errors import ConfigError
from zjax.lora import BaseCodec, LoraConfig, is_adapter
from zjax.models.trainable import Trainable
from zjax.partition.plan import path_str

__all__ = ["with_adapters"]


def with_adapters(trainable: Trainable, lora: LoraConfig, *,
                  names: tuple[str, ...] = ()) -> Trainable:
    """``trainable`` (a model built with ``lora``'s adapters) with only its adapters trained:
    the base is frozen, its float leaves stored (and gathered) in ``lora.base_dtype``;
    ``names``: the leaves (last path component) the model stores quantized under an
    ``int8``/``nf4`` base. With ``lora.dropout``, the masks' seed is 0 (set
    ``dropout_seed`` for another)."""
    # a quantized base (int8, nf4): its linear weights come quantized from the model, the
    # rest (embeddings, norms, head) in bfloat16
    dtype = jnp.dtype("bfloat16" if lora.quantized else lora.base_dtype)

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
    codec = BaseCodec(lora.base_dtype, frozenset(names)) if lora.quantized and names else None
    return dataclasses.replace(trainable, init=init, frozen=lambda path: not is_adapter(path),
                               codec=codec, dropout_seed=0 if lora.dropout else None)
