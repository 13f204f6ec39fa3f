"""Logical axis rules: the one place that maps a model's logical dimensions to mesh axes.

A model names the dimensions of its weights (``("embed", "mlp")``); the rules say which mesh
axis splits each name. zjax's tensor parallelism follows Megatron-LM: attention heads and the MLP
hidden dimension are split over ``model`` (QKV and up projections column-parallel, the attention
output and down projections row-parallel); everything else stays whole on the ``model`` axis.
ZeRO then shards every leaf over ``data`` along another dimension (:mod:`zjax.partition.plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

from zjax.runtime.mesh import MODEL

__all__ = ["DEFAULT_RULES", "Rules", "model_dim"]

Rules = tuple[tuple[str, str | None], ...]

DEFAULT_RULES: Rules = (
    ("heads", MODEL),  # attention heads: QKV columns, output-projection rows
    ("mlp", MODEL),  # MLP hidden units: up-projection columns, down-projection rows
    ("embed", None),  # the residual stream stays whole (activations replicated over model)
    ("vocab", None),  # embedding rows / LM-head columns: not vocab-parallel
)


def model_dim(logical: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES, *,
              offset: int = 0) -> int | None:
    """The dimension the rules split over ``model``, or None.

    Args:
      logical: the leaf's logical axis names (one per dimension, None for unnamed), or None.
      rules: ``(logical name, mesh axis or None)`` pairs; the first match wins.
      offset: added to the result (1 for a stacked leaf whose names omit the layer dimension).
    """
    if not logical:
        return None
    table = {}
    for name, axis in rules:
        table.setdefault(name, axis)
    dims = [i for i, name in enumerate(logical) if name is not None and table.get(name) == MODEL]
    if len(dims) > 1:
        raise ValueError(f"logical axes {tuple(logical)} map more than one dimension to {MODEL}")
    return dims[0] + offset if dims else None
