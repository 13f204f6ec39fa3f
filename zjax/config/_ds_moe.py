"""DeepSpeed-MoE's ``moe`` section of a DeepSpeed config, as zjax overrides.

DeepSpeed sets a mixture's training in the model's code (``deepspeed.moe.layer.MoE(
num_experts=, ep_size=, k=, capacity_factor=, ...)``); the one config section it reads is
``moe`` (``enabled``, ``ep_size``, ``num_experts`` alias ``moe_experts``, ``type``, and the
process groups ``ep_group`` / ``ep_mp_group``). ``ep_size`` is the expert-parallel group:
``mesh.expert``; the experts' count is ``model.n_experts`` (one count for every layer).
"""

from __future__ import annotations

from typing import Any

from zjax.config._ds_reader import Reader, number
from zjax.errors import ConfigError

__all__ = ["moe"]

_GROUPS = ("ep_group", "expert_group", "ep_mp_group", "expert_mp_group")
_KNOWN = ("enabled", "ep_size", "num_experts", "moe_experts", "type", *_GROUPS)


def moe(r: Reader, d: dict, *, n_data: int) -> None:
    """Read the ``moe`` section ``d`` into ``r``; ``n_data``: the data ranks ``ep_size``
    splits (the devices over ``mesh.model`` and ``sequence_parallel_size``).

    Raises:
      ConfigError: naming the key: an unknown one, an ``ep_size`` that does not divide the
        data ranks, experts that differ by layer, the residual (PR-MoE) type.
    """
    enabled = d.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"deepspeed moe.enabled: expected true or false, got {enabled!r}")
    if not enabled:
        r.ignore("moe", "not enabled")
        return
    for key, value in d.items():
        where = f"moe.{key}"
        if key == "enabled":
            continue
        if key == "ep_size":
            size = number(where, value, int)
            if size < 1 or n_data % size:
                raise ConfigError(f"deepspeed {where}: {size} does not divide the {n_data} "
                                  "data ranks (devices over mesh.model and mesh.context)")
            r.set("mesh.expert", size)
        elif key in ("num_experts", "moe_experts"):
            r.set("model.n_experts", _experts(where, value))
        elif key == "type":
            _type(where, value)
        elif key in _GROUPS:
            if value is not None:
                raise ConfigError(f"deepspeed {where}: a process group; zjax's mesh makes the "
                                  "expert groups (mesh.expert)")
            r.ignore(where, "zjax's mesh makes the expert groups")
        else:
            raise r.unknown(where, _KNOWN)


def _experts(where: str, value: Any) -> int:
    """DeepSpeed's experts: a count, or one per MoE layer (zjax's are the same in each)."""
    counts = [number(where, v, int) for v in (value if isinstance(value, list) else [value])]
    if not counts or min(counts) < 1:
        raise ConfigError(f"deepspeed {where}: {value!r}; expected a positive count of experts")
    if len(set(counts)) > 1:
        raise ConfigError(f"deepspeed {where}: {value!r}: the experts differ by layer; zjax's "
                          "model.n_experts is one count for every layer")
    return counts[0]


def _type(where: str, value: Any) -> None:
    if value == "residual":
        raise ConfigError(f"deepspeed {where}: 'residual' (PR-MoE: a dense MLP mixed with "
                          "the routed expert by a learned coefficient) is not in zjax; "
                          "model.n_shared_experts adds experts every token uses")
    if value != "standard":
        raise ConfigError(f"deepspeed {where}: {value!r}; expected 'standard' or 'residual'")
