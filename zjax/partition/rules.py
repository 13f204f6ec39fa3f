"""Logical axis rules: the one place that maps a model's logical dimensions to mesh axes.

A model names the dimensions of its weights (``("embed", "mlp")``); the rules say which mesh
axis splits each name. zjax's tensor parallelism follows Megatron-LM: attention heads and the MLP
hidden dimension are split over ``model`` (QKV and up projections column-parallel, the attention
output and down projections row-parallel); everything else stays whole on the ``model`` axis.
A mixture's ``expert`` dimension is split over the ``expert`` axis (expert parallelism).
ZeRO then shards every leaf over ``data`` along another dimension (:mod:`zjax.partition.plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

from zjax.runtime.mesh import EXPERT, MODEL

__all__ = ["DEFAULT_RULES", "Rules", "axis_dim", "model_dim"]

Rules = tuple[tuple[str, str | None], ...]

DEFAULT_RULES: Rules = (
    ("heads", MODEL),  # attention heads: QKV columns, output-projection rows
    ("mlp", MODEL),  # MLP hidden units: up-projection columns, down-projection rows
    ("embed", None),  # the residual stream stays whole (activations replicated over model)
    ("vocab", None),  # embedding rows / LM-head columns: not vocab-parallel
    ("expert", EXPERT),  # a mixture's experts: split over the expert axis
)


def axis_dim(logical: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES, *,
             axis: str = MODEL, offset: int = 0) -> int | None:
    """The dimension the rules split over mesh ``axis``, or None.

    Args:
      logical: the leaf's logical axis names (one per dimension, None for unnamed), or None.
      rules: ``(logical name, mesh axis or None)`` pairs; the first match wins.
      axis: the mesh axis (``model``, ``expert``).
      offset: added to the result (1 for a stacked leaf whose names omit the layer dimension).
    """
    if not logical:
        return None
    table = {}
    for name, mesh_axis in rules:
        table.setdefault(name, mesh_axis)
    dims = [i for i, name in enumerate(logical) if name is not None and table.get(name) == axis]
    if len(dims) > 1:
        raise ValueError(f"logical axes {tuple(logical)} map more than one dimension to {axis}")
    return dims[0] + offset if dims else None


def model_dim(logical: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES, *,
              offset: int = 0) -> int | None:
    """The dimension the rules split over ``model`` (:func:`axis_dim`), or None."""
    return axis_dim(logical, rules, axis=MODEL, offset=offset)
