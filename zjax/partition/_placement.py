"""Where one parameter leaf goes: the dimensions the rules split over ``model`` and ``expert``,
the mesh axes ZeRO shards it over, and the dimension it shards (helpers of ``plan.py``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from jax.sharding import Mesh

from zjax.errors import ArgumentError, ConfigError
from zjax.partition.config import ZeroConfig
from zjax.partition.rules import Rules, axis_dim
from zjax.runtime.mesh import EXPERT, MODEL, describe_axes, shard_axes

__all__ = ["Split", "choose_dim", "nothing_to_shard", "persistence_threshold", "split_of"]


class Split:
    """A leaf's tensor-parallel and expert-parallel dimensions and ZeRO's axes for it.

    Attributes:
      model_dim: the dimension split over ``model``, or None.
      expert_dim: the dimension split over ``expert`` (a mixture's experts), or None.
      data_axes: the mesh axes ZeRO shards it over (no ``expert`` for an expert leaf).
      n: the shards of a sharded leaf: the product of those axes' sizes.
      over: those axes as the config keys that size them (``mesh.data 3 x mesh.context 2``).
    """

    def __init__(self, model_dim: int | None, expert_dim: int | None, mesh: Mesh):
        self.model_dim, self.expert_dim = model_dim, expert_dim
        self.data_axes = shard_axes(mesh, experts=expert_dim is not None)
        axes = (self.data_axes,) if isinstance(self.data_axes, str) else self.data_axes
        self.n = int(np.prod([mesh.shape[a] for a in axes]))
        self.over = describe_axes(mesh, self.data_axes)


def _named_dim(path, shape, names, offset, rules, axis: str, size: int) -> int | None:
    dim = axis_dim(names, rules, axis=axis, offset=offset)
    if dim is not None and size > 1 and shape[dim] % size:
        raise ArgumentError(
            "mesh" if axis == MODEL else f"mesh.{axis}",
            f"the {axis} axis ({size}) does not divide the {names[dim - offset]!r} "
            f"dimension of {path} (size {shape[dim]}, shape {shape}); use a {axis} axis size "
            f"that divides {shape[dim]}")
    return dim if size > 1 else None


def split_of(path: str, shape: tuple[int, ...], stacked: bool,
             logical_axes: Callable[[str], tuple[str | None, ...] | None] | None,
             rules: Rules, mesh: Mesh) -> Split:
    """The :class:`Split` of the leaf at ``path`` (its logical axis names through ``rules``).

    Raises:
      ArgumentError: a mesh axis does not divide the dimension it must split.
    """
    names = logical_axes(path) if logical_axes else None
    if not names:
        return Split(None, None, mesh)
    names = tuple(names)
    offset = 1 if stacked and len(names) == len(shape) - 1 else 0
    if len(names) + offset != len(shape):
        raise ValueError(f"{path}: logical axes {names} do not match its shape {shape}")
    dims = [_named_dim(path, shape, names, offset, rules, axis, mesh.shape.get(axis, 1))
            for axis in (MODEL, EXPERT)]
    return Split(*dims, mesh)


def persistence_threshold(zero: ZeroConfig, *, adapter: bool) -> int:
    """The persistence threshold of a leaf. An adapter over a frozen base is sharded whatever
    its size: persisting it would save one small gather (made in its layer's step, beside the
    base's) at the price of its whole float32 master, gradient and Adam moments (16 bytes an
    element) on every device: the state a LoRA step's memory grows with."""
    return 0 if adapter else zero.param_persistence_threshold


def choose_dim(shape, *, n: int, stacked: bool, threshold: int,
               taken: tuple[int | None, ...] = (), over: str = "") -> tuple[int | None, str]:
    """The dimension ZeRO shards ``n`` ways (the largest one ``n`` divides, never the stacked
    layer dimension nor one in ``taken``, which tensor or expert parallelism splits), or
    ``(None, why it stays whole)``; ``over``: the mesh axes of the ``n`` shards, for that
    reason (``mesh.data 3 x mesh.context 2``)."""
    per_layer = int(np.prod(shape[1:] if stacked else shape, dtype=np.int64))
    if n == 1:
        return None, "data axis has size 1"
    if per_layer < threshold:
        what = "elements per layer" if stacked else "elements"
        return None, f"persistent: {per_layer} {what} < param_persistence_threshold {threshold}"
    first = 1 if stacked else 0
    candidates = [d for d in range(first, len(shape)) if shape[d] % n == 0 and d not in taken]
    if not candidates:
        dims = shape[first:]
        split = [d for d in taken if d is not None]
        besides = "" if not split else \
            f" besides the model- or expert-split dimension{'s' * (len(split) > 1)} " \
            f"{', '.join(map(str, split))}"
        ways = f"{n} shards ({over})" if over else f"{n} shards"
        return None, f"no dimension of {tuple(dims)}{besides} divisible by its {ways}"
    # largest dimension; the last one on ties (keeps contiguous shards for row-major matmuls)
    best = max(candidates, key=lambda d: (shape[d], d))
    return best, ""


def nothing_to_shard(leaves, threshold: int) -> ConfigError:
    """Stage 3's error when every leaf stays whole, for ``leaves`` (``LeafPlan``s with their
    ``shape`` and ``reason``): it shows the largest leaf and its reason, and advises what
    would shard it (a shard count dividing a dimension, or a lower persistence threshold)."""
    undivided = [leaf for leaf in leaves if "divisible by" in leaf.reason]
    pool = undivided or [leaf for leaf in leaves if leaf.reason.startswith("persistent")] \
        or list(leaves)
    big = max(pool, key=lambda leaf: int(np.prod(leaf.shape, dtype=np.int64)))
    if undivided:
        advice = ("choose mesh sizes whose shard count divides one of its dimensions, or use "
                  "stage 0")
    else:
        advice = f"lower zero.param_persistence_threshold ({threshold}) or use stage 0"
    return ConfigError(f"zero.stage: 3 has nothing to shard: every leaf stays whole (the "
                       f"largest, {big.path} {tuple(big.shape)}: {big.reason}); {advice}")
