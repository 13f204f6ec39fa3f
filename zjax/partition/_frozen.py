"""A plan's trained and frozen leaves apart: the step differentiates, updates and checkpoints
the trained part; the frozen part (an adapter's base) is only read.

Both parts are trees of dicts holding their leaves under the full tree's keys, so a part's
leaves are in the full tree's order and :func:`merge_parts` puts them back by the plan's flags.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zjax.partition.plan import ShardPlan

__all__ = ["frozen_part", "merge_parts", "plan_part", "split_parts", "trained_part"]


def _nested(keys: list[tuple], values: list) -> dict:
    out: dict = {}
    for path, v in zip(keys, values, strict=True):
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def _keys(plan: ShardPlan) -> list[tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(plan.tree(range(len(plan.leaves))))
    keys = []
    for path, _ in flat:
        if not all(isinstance(k, jax.tree_util.DictKey) for k in path):
            raise ValueError(f"frozen leaves need params that are dicts of dicts; "
                             f"{jax.tree_util.keystr(path)} is not a dict key")
        keys.append(tuple(k.key for k in path))
    return keys


def plan_part(plan: ShardPlan, *, frozen: bool) -> ShardPlan:
    """The plan of the frozen (``frozen=True``) or the trained leaves only: the same mesh,
    section and placements, over the tree of those leaves."""
    chosen = [(k, leaf) for k, leaf in zip(_keys(plan), plan.leaves, strict=True)
              if leaf.frozen == frozen]
    treedef = jax.tree.structure(_nested([k for k, _ in chosen], [0] * len(chosen)))
    return dataclasses.replace(plan, leaves=tuple(leaf for _, leaf in chosen),
                               treedef=treedef)


def split_parts(plan: ShardPlan, tree: Any) -> tuple[Any, Any]:
    """``(trained, frozen)``: the parts of a full ``tree`` laid out as ``plan``."""
    values = jax.tree.leaves(tree)
    trained = [v for v, leaf in zip(values, plan.leaves, strict=True) if not leaf.frozen]
    frozen = [v for v, leaf in zip(values, plan.leaves, strict=True) if leaf.frozen]
    return (plan_part(plan, frozen=False).tree(trained),
            plan_part(plan, frozen=True).tree(frozen))


def merge_parts(plan: ShardPlan, trained: Any, frozen: Any) -> Any:
    """The full tree of ``plan`` from its two parts (the inverse of :func:`split_parts`);
    ``trained`` itself when ``frozen`` is None."""
    if frozen is None:
        return trained
    t, f = iter(jax.tree.leaves(trained)), iter(jax.tree.leaves(frozen))
    return plan.tree(next(f) if leaf.frozen else next(t) for leaf in plan.leaves)


def trained_part(plan: ShardPlan) -> ShardPlan:
    """The plan of the trained leaves: ``plan`` itself when no leaf is frozen."""
    return plan_part(plan, frozen=False) if any(leaf.frozen for leaf in plan.leaves) else plan


def frozen_part(plan: ShardPlan) -> ShardPlan | None:
    """The plan of the frozen leaves, or None when no leaf is frozen."""
    return plan_part(plan, frozen=True) if any(leaf.frozen for leaf in plan.leaves) else None
