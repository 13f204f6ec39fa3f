"""ZeRO partitioning: placement plan, gather primitive, scheduled layer scan."""

from zjax.partition.config import ZeroConfig
from zjax.partition.gather import (
    GATHERED,
    REMAT_POLICY,
    gather,
    gather_on_access,
    gather_tree,
    join_gathers,
)
from zjax.partition.plan import LeafPlan, ShardPlan, bytes_per_device, make_plan
from zjax.partition.schedule import ScheduleSpec, scheduled_scan

__all__ = [
    "GATHERED",
    "REMAT_POLICY",
    "LeafPlan",
    "ScheduleSpec",
    "ShardPlan",
    "ZeroConfig",
    "bytes_per_device",
    "gather",
    "gather_on_access",
    "gather_tree",
    "join_gathers",
    "make_plan",
    "scheduled_scan",
]
