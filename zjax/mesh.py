"""The device mesh (``data``, ``model``) and CPU device simulation.

This module reads the process environment (``XLA_FLAGS``) on purpose: simulating devices must
happen before jax initialises its backends.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
from jax.sharding import AxisType, Mesh

from zjax._schema import choices
from zjax.errors import ConfigError

__all__ = ["DATA", "MODEL", "MeshConfig", "make_mesh", "simulate_cpu_devices"]

DATA = "data"
MODEL = "model"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The ``mesh`` section: axis sizes; one may be -1 to take all remaining devices.

    Attributes:
      data: size of the ``data`` axis (ZeRO shards along it).
      model: size of the ``model`` axis (tensor parallelism; 1 for now).
      distributed: join a multi-process job through ``jax.distributed``: ``auto`` when the
        environment says this process is one of several (``zjax launch``, ``ZJAX_*``
        variables, SLURM, Open MPI), ``on`` to require it, ``off`` to run alone.
      init_timeout_s: how long a process waits for the coordinator before a clear error.
    """

    data: int = -1
    model: int = 1
    distributed: str = choices("auto", "on", "off", default="auto")
    init_timeout_s: int = 300

    def __post_init__(self):
        for key in ("data", "model"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ConfigError(f"mesh.{key}: must be a positive size or -1, got {value}")
        if self.data == -1 and self.model == -1:
            raise ConfigError("mesh.data and mesh.model are both -1; at most one may be -1")
        if self.init_timeout_s <= 0:
            raise ConfigError(f"mesh.init_timeout_s: must be > 0, got {self.init_timeout_s}")


def simulate_cpu_devices(n: int) -> None:
    """Make the CPU backend expose ``n`` devices. Call before jax creates its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    jax.config.update("jax_num_cpu_devices", n)


def make_mesh(config: MeshConfig | None = None, *, devices=None) -> Mesh:
    """Build the ``(data, model)`` mesh with automatic (GSPMD) axis types.

    Args:
      config: axis sizes; ``-1`` takes all devices left.
      devices: devices to use (default: all of ``jax.devices()``).
    """
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    data, model = config.data, config.model
    if data == -1:
        if n % model:
            raise ConfigError(f"mesh.model: {model} does not divide the {n} devices")
        data = n // model
    elif model == -1:
        if n % data:
            raise ConfigError(f"mesh.data: {data} does not divide the {n} devices")
        model = n // data
    if data * model != n:
        raise ConfigError(
            f"mesh: data={data} x model={model} = {data * model} does not equal the {n} devices"
        )
    return jax.make_mesh(
        (data, model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto), devices=devices
    )
