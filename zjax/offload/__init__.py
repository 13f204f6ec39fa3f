"""Host offload (ZeRO-Offload) through JAX memory kinds, and the NVMe tier's streaming
optimizer engine (ZeRO-Infinity; the steps that use it are `zjax.step._nvme` and
`zjax.step._streamed`).

It owns the ``zero.offload_optimizer`` / ``zero.offload_param`` sections
(``zjax.offload.config``) and imports only ``zjax.errors`` and the sections; the step, the
checkpoint and planning import it."""

from zjax.offload._nvme_store import NvmeStore
from zjax.offload.config import OffloadConfig, OptimizerOffloadConfig
from zjax.offload.host import (
    check_memory_kind,
    global_norm,
    on_host,
    on_host_compute,
    to_device,
    to_host,
)
from zjax.offload.nvme import (
    StreamingOptimizer,
    StreamStats,
    Update,
    check_elementwise,
    sum_squares,
)

__all__ = [
    "NvmeStore",
    "OffloadConfig",
    "OptimizerOffloadConfig",
    "StreamStats",
    "StreamingOptimizer",
    "Update",
    "check_elementwise",
    "check_memory_kind",
    "global_norm",
    "on_host",
    "on_host_compute",
    "sum_squares",
    "to_device",
    "to_host",
]
