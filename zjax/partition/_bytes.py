"""Bytes of arrays, whole or per device: the one byte count the plan, the report, the trainer
and the benchmarks share."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["nbytes"]


def nbytes(tree: Any, *, per_device: bool = True, memory: str | None = None) -> int:
    """Bytes of the arrays (or ``ShapeDtypeStruct``s) of ``tree``.

    Args:
      tree: arrays or ``ShapeDtypeStruct``s; with ``per_device`` each needs a ``sharding``.
      per_device: count one device's shard of each leaf (its sharding's ``shard_shape``)
        instead of the whole leaf.
      memory: count only leaves in this memory: ``"host"`` (a memory kind ending in
        ``host``, e.g. ``pinned_host``) or ``"device"`` (any other, or none given).
        ``compiled.memory_analysis()`` does not separate the two on every backend.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if memory is not None:
            kind = (sharding.memory_kind if sharding is not None else None) or "device"
            if ("host" if kind.endswith("host") else "device") != memory:
                continue
        shape = sharding.shard_shape(leaf.shape) if per_device else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
