"""The ``zero.offload_optimizer`` and ``zero.offload_param`` config sections (ZeRO-Offload)."""

from __future__ import annotations

import dataclasses

from zjax.errors import ConfigError, did_you_mean
from zjax.schema import positive, validate

__all__ = ["DEVICES", "OffloadConfig", "OptimizerOffloadConfig"]

DEVICES = ("none", "host", "nvme")
_ALIASES = {"cpu": "host"}  # DeepSpeed's name for the same tier


def _check_device(key: str, device: str) -> str:
    device = _ALIASES.get(device, device)
    if device not in DEVICES:
        raise ConfigError(f"{key}: {device!r} is not allowed{did_you_mean(device, DEVICES)}; "
                          f"choose one of {', '.join(DEVICES)} ('cpu' is read as 'host')")
    return device


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Offload:
    """Where a part of the model state lives between steps.

    Attributes:
      device: ``none`` keeps it in device memory; ``host`` keeps it in host memory (JAX memory
        kind ``pinned_host``) and brings it in as the step needs it; ``nvme`` (ZeRO-Infinity)
        keeps it in swap files under the section's ``nvme_path``.
        ``cpu`` is read as ``host``.
      pin_memory: page-locked host memory (``pinned_host``, fast DMA) rather than pageable
        (``unpinned_host``), as DeepSpeed's ``pin_memory``.
    """

    device: str = "none"
    pin_memory: bool = True

    def __post_init__(self):
        validate(self, self._key("")[:-1])
        object.__setattr__(self, "device", _check_device(self._key("device"), self.device))

    def _key(self, name: str) -> str:
        return f"zero.offload_param.{name}"

    @property
    def enabled(self) -> bool:
        return self.device == "host"

    @property
    def nvme(self) -> bool:
        """Whether it lives in swap files under ``nvme_path``."""
        return self.device == "nvme"

    @property
    def memory_kind(self) -> str:
        """The JAX memory kind of the offloaded arrays."""
        return "pinned_host" if self.pin_memory else "unpinned_host"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig(_Offload):
    """Where the parameters live between uses (DeepSpeed ``offload_param``).

    Attributes:
      nvme_path: with ``device: nvme`` (stage 3, with ``zero.offload_optimizer.device: nvme``),
        the directory of the swap files: the step streams each layer's parameters from the
        optimizer's float32 master there (:mod:`zjax.step._streamed`), so no parameter
        stays in device or host memory between its uses. Defaults to
        ``zero.offload_optimizer.nvme_path``.
      buffer_count: with ``device: nvme``, host buffers of layers read ahead of the one the
        devices compute (DeepSpeed's ``buffer_count``).
      buffer_size: with ``device: nvme``, elements of one buffer: this process's shards of one
        layer must fit in it (DeepSpeed's ``buffer_size``: the largest parameter must fit).
        Host memory holds about ``buffer_count x buffer_size x 4`` bytes of them.
    """

    nvme_path: str | None = None
    buffer_count: int = positive(5)
    buffer_size: int = positive(100_000_000)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerOffloadConfig(_Offload):
    """Where the optimizer state lives and where its update runs (DeepSpeed ``offload_optimizer``).

    Attributes:
      nvme_path: with ``device: nvme``, the directory of the swap files (a local NVMe disk);
        each process writes its own devices' shards into a locked directory of its own there,
        so runs may share the path; one left by a killed run is removed by the next run.
      buffer_count: with ``device: nvme``, sub-groups read ahead and written behind the one
        being updated (and I/O threads). Its buffers are ordinary host memory: ``pin_memory``
        does not apply to them.
      update_on: ``device`` brings the offloaded state in for the update and sends it back;
        ``host`` runs the optax update itself on the host (``compute_on("device_host")``), so
        the moments never occupy device memory.
    """

    nvme_path: str | None = None
    buffer_count: int = positive(4)
    update_on: str = "device"

    def __post_init__(self):
        super().__post_init__()
        if self.nvme and not self.nvme_path:
            raise ConfigError(f"{self._key('nvme_path')}: required with device: nvme (the "
                              "directory of the swap files, on a local NVMe disk)")
        if self.update_on not in ("device", "host"):
            raise ConfigError(
                f"zero.offload_optimizer.update_on: {self.update_on!r} is not allowed"
                f"{did_you_mean(self.update_on, ('device', 'host'))}; choose one of device, host")
        if self.update_on == "host" and not (self.enabled or self.nvme):
            raise ConfigError("zero.offload_optimizer.update_on: 'host' needs "
                              "zero.offload_optimizer.device: host (with nvme the update "
                              "always runs on the host)")

    def _key(self, name: str) -> str:
        return f"zero.offload_optimizer.{name}"

    @property
    def update_on_host(self) -> bool:
        return self.enabled and self.update_on == "host"
