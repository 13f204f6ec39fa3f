"""A mixture of experts' figures in the plan: where the experts sit and what moves them.

Expert leaves are the ones the rules split over ``expert`` (or, on a mesh without that axis,
the ones whose shape a model's ``n_experts`` names: :func:`expert_figures` is told which by the
plan's ``expert_dim``). Their all-to-all bytes are the compiled HLO's all-to-alls over the
``expert`` axis (the dispatch of each token's assignments to its experts' devices and the
combine back), apart from sequence parallelism's over ``context``.
"""

from __future__ import annotations

from typing import Any

from zjax.partition import ShardPlan

__all__ = ["expert_all_to_all", "expert_figures"]


def expert_all_to_all(by_axis: dict[str, dict[str, int]]) -> int:
    """All-to-all bytes per step over mesh axes that include ``expert``."""
    return sum(kinds.get("all_to_all", 0) for axes, kinds in by_axis.items()
               if "expert" in axes.split("+"))


def expert_figures(plan: ShardPlan, by_axis: dict[str, dict[str, int]], *,
                   n_experts: int | None, n_layers: int | None) -> dict[str, Any]:
    """Per-device figures of a mixture's experts under ``plan``.

    Args:
      plan: the step's shard plan.
      by_axis: the compiled step's collective bytes by mesh axes (``CollectiveBytes.by_axis``).
      n_experts: the model's routed experts; None: read off the leaves split over ``expert``.
      n_layers: the model's layers (for the per-layer all-to-all), or None.

    Returns:
      ``{}`` for a model without experts, else
      ``n_experts``, ``experts_per_device`` (the routed experts one device computes),
      ``expert_params`` (every layer's routed-expert parameters, all experts),
      ``params_bytes`` (the expert parameters one device stores, in their stored dtype),
      ``gathered_layer_bytes`` (one layer's experts gathered on a device for use, in
      ``zero.gather_dtype``: what ZeRO-3 brings in per layer), ``all_to_all_bytes`` (tensor
      bytes per step), ``all_to_all_off_device_bytes`` (the ``(E - 1) / E`` of them bound for
      other devices of the ``expert`` axis) and ``all_to_all_per_layer``.
    """
    split = [leaf for leaf in plan.leaves if leaf.expert_dim is not None]
    if n_experts is None and split:
        n_experts = split[0].shape[split[0].expert_dim]
    if not n_experts:
        return {}
    leaves = split or [leaf for leaf in plan.leaves
                       if _names_experts(leaf.shape, n_experts, leaf.stacked)]
    stage3 = plan.zero.stage >= 3
    layers = max(1, n_layers or 1)
    gathered = sum(plan.leaf_bytes(leaf, plan.zero.gather, False)
                   // (layers if leaf.stacked else 1) for leaf in leaves)
    a2a = expert_all_to_all(by_axis)
    return {
        "n_experts": n_experts,
        "experts_per_device": n_experts // plan.n_expert,
        "expert_params": sum(leaf.size for leaf in leaves),
        "params_bytes": sum(plan.leaf_bytes(leaf, leaf.dtype, stage3) for leaf in leaves),
        "gathered_layer_bytes": gathered,
        "all_to_all_bytes": a2a,
        "all_to_all_off_device_bytes": a2a * (plan.n_expert - 1) // plan.n_expert,
        "all_to_all_per_layer": a2a // layers if n_layers else None,
    }


def _names_experts(shape: tuple[int, ...], n_experts: int, stacked: bool) -> bool:
    """Whether a leaf holds one weight per expert: its first dimension after the layers'
    is the experts' (``[layers, experts, ...]``, as the Llama family's expert weights)."""
    lead = 1 if stacked else 0
    return len(shape) >= lead + 3 and shape[lead] == n_experts
