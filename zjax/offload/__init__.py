"""Host offload (ZeRO-Offload) through JAX memory kinds."""

from zjax.offload.config import OffloadConfig, OptimizerOffloadConfig
from zjax.offload.host import (
    check_memory_kind,
    global_norm,
    on_host,
    on_host_compute,
    to_device,
    to_host,
)

__all__ = [
    "OffloadConfig",
    "OptimizerOffloadConfig",
    "check_memory_kind",
    "global_norm",
    "on_host",
    "on_host_compute",
    "to_device",
    "to_host",
]
