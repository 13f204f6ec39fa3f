"""ZeRO partitioning: placement plan, gather primitive, scheduled layer scan, gather on use,
and the layer scan that keeps saved inputs as ZeRO-R does over whole params (stages 0-2).

It owns the ``zero`` section (``zjax.partition.config``) and the FP8 scaling that
``zero.fp8_gather``'s gathers share with ``zjax.nn``'s FP8 matmuls (``zjax.partition.fp8``),
and imports only the runtime (mesh axes, the backend's record) and ``zjax.errors``: nothing
about models, steps or files."""

from zjax.partition._bytes import nbytes
from zjax.partition._frozen import (
    frozen_part,
    merge_parts,
    plan_part,
    split_parts,
    trained_part,
)
from zjax.partition._kept_scan import kept_scan
from zjax.partition.config import ZeroConfig
from zjax.partition.gather import (
    GATHERED,
    REMAT_POLICY,
    Comm,
    gather,
    gather_on_access,
    gather_tree,
    join_gathers,
)
from zjax.partition.plan import LeafPlan, ShardPlan, make_plan
from zjax.partition.schedule import ScheduleSpec, scheduled_loop, scheduled_scan
from zjax.partition.transform import LeafSpec, gather_on_use

__all__ = [
    "GATHERED",
    "REMAT_POLICY",
    "Comm",
    "LeafPlan",
    "LeafSpec",
    "ScheduleSpec",
    "ShardPlan",
    "ZeroConfig",
    "frozen_part",
    "gather",
    "gather_on_access",
    "gather_on_use",
    "gather_tree",
    "join_gathers",
    "kept_scan",
    "make_plan",
    "merge_parts",
    "nbytes",
    "plan_part",
    "scheduled_loop",
    "scheduled_scan",
    "split_parts",
    "trained_part",
]
