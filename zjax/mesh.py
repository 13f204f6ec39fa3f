"""The device mesh (``data``, ``model``, and ``replica`` for hybrid sharding) and CPU device
simulation.

This module reads the process environment (``XLA_FLAGS``, ``PJRT_NPROC``) on purpose:
simulating devices must happen before jax initialises its backends.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zjax._schema import choices, positive, validate
from zjax.errors import ConfigError

__all__ = ["DATA", "MODEL", "REPLICA", "MeshConfig", "batch_axes", "make_mesh",
           "process_batch_slice", "simulate_cpu_devices", "simulated_device_env"]

DATA = "data"
MODEL = "model"
REPLICA = "replica"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The ``mesh`` section: axis sizes; one may be -1 to take all remaining devices.

    Attributes:
      data: size of the ``data`` axis (ZeRO shards along it).
      model: size of the ``model`` axis (tensor parallelism: the model's heads and MLP
        hidden units are split over it; ZeRO shards over ``data``).
      replica: size of the ``replica`` axis, hybrid sharding (PyTorch FSDP2's HSDP,
        DeepSpeed's MiCS): ZeRO shards over the ``data`` devices of each replica group and
        every group holds the same shards; the batch is split over replica x data, gradients
        are reduce-scattered over ``data`` then all-reduced over ``replica`` (shards only).
        Put ``data`` within a node and ``replica`` across nodes.
      distributed: join a multi-process job through ``jax.distributed``: ``auto`` when the
        environment says this process is one of several (``zjax launch``, ``ZJAX_*``
        variables, SLURM, Open MPI), ``on`` to require it, ``off`` to run alone.
      init_timeout_s: how long a process waits for the coordinator before a clear error.
    """

    data: int = positive(-1, also=(-1,))
    model: int = positive(1, also=(-1,))
    replica: int = positive(1)
    distributed: str = choices("auto", "on", "off", default="auto")
    init_timeout_s: int = positive(300)

    def __post_init__(self):
        validate(self, "mesh")
        if self.data == -1 and self.model == -1:
            raise ConfigError("mesh.data and mesh.model are both -1; at most one may be -1")


# Threads XLA:CPU gets per simulated device (PJRT_NPROC). Its thread pool defaults to
# max(cores, devices): exactly one thread per device on a small machine. A collective's
# rendezvous blocks a pool thread until every device arrives, and a device may start a second,
# independent collective (one in a scan body, one outside it) on another thread; with no thread
# left for the last device to arrive, the step deadlocks and XLA aborts after 40 s (measured
# here: 2 cores, 8 devices). Four per device leaves room for three collectives in flight.
_THREADS_PER_DEVICE = 4


def simulated_device_env(n: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that make a process's CPU backend expose ``n`` devices.

    ``XLA_FLAGS`` gains ``--xla_force_host_platform_device_count=n`` (replacing any earlier
    count), and ``PJRT_NPROC`` sizes XLA:CPU's thread pool so that collectives across the
    simulated devices cannot starve it (see ``_THREADS_PER_DEVICE``); a ``PJRT_NPROC`` already
    set is kept.

    Args:
      n: number of devices to simulate.
      environ: the environment to start from (default: this process's).
    """
    environ = os.environ if environ is None else environ
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   environ.get("XLA_FLAGS", ""))
    env = {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}
    if not environ.get("PJRT_NPROC"):
        env["PJRT_NPROC"] = str(max(os.cpu_count() or 1, _THREADS_PER_DEVICE * n))
    return env


def simulate_cpu_devices(n: int) -> None:
    """Make the CPU backend expose ``n`` devices. Call before jax creates its backends."""
    os.environ.update(simulated_device_env(n))
    jax.config.update("jax_num_cpu_devices", n)


def make_mesh(config: MeshConfig | None = None, *, devices=None) -> Mesh:
    """Build the ``(data, model)`` mesh, or ``(replica, data, model)`` with ``replica`` > 1,
    with automatic (GSPMD) axis types.

    Args:
      config: axis sizes; ``-1`` takes all devices left.
      devices: devices to use (default: all of ``jax.devices()``).
    """
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    n, replica = len(devices), config.replica
    data, model = config.data, config.model
    times = f" x mesh.replica {replica}" if replica > 1 else ""
    if data == -1:
        if n % (model * replica):
            raise ConfigError(f"mesh.model: {model}{times} does not divide the {n} devices")
        data = n // (model * replica)
    elif model == -1:
        if n % (data * replica):
            raise ConfigError(f"mesh.data: {data}{times} does not divide the {n} devices")
        model = n // (data * replica)
    if replica * data * model != n:
        axes = f"replica={replica} x " if replica > 1 else ""
        raise ConfigError(
            f"mesh: {axes}data={data} x model={model} = {replica * data * model} does not "
            f"equal the {n} devices")
    if replica == 1:
        return jax.make_mesh((data, model), (DATA, MODEL),
                             axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
    return jax.make_mesh((replica, data, model), (REPLICA, DATA, MODEL),
                         axis_types=(AxisType.Auto,) * 3, devices=devices)


def batch_axes(mesh: Mesh) -> str | tuple[str, str]:
    """The mesh axes a global batch is split over: ``data``, or ``(replica, data)``."""
    return (REPLICA, DATA) if REPLICA in mesh.axis_names else DATA


def process_batch_slice(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
    """Which of ``count`` equal slices of each global batch this process loads: ``(i, count)``.

    The batch is split over ``replica`` x ``data`` only, so processes whose devices sit at the
    same coordinates there (a ``model`` axis spanning processes) load the same slice.
    """
    process_index = jax.process_index() if process_index is None else process_index
    names = mesh.axis_names
    n_data = mesh.shape[DATA]
    rows: dict[int, set] = {}
    for idx in np.ndindex(mesh.devices.shape):
        replica = idx[names.index(REPLICA)] if REPLICA in names else 0
        rows.setdefault(mesh.devices[idx].process_index, set()).add(
            replica * n_data + idx[names.index(DATA)])
    slices = sorted({tuple(sorted(r)) for r in rows.values()})
    flat = [i for s in slices for i in s]
    if len(flat) != len(set(flat)) or len({len(s) for s in slices}) != 1:
        shape = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
        raise ConfigError(
            f"mesh: {shape} gives the processes overlapping or unequal slices of the batch "
            f"({slices}); choose axis sizes whose data rows divide evenly among the processes"
        )
    return slices.index(tuple(sorted(rows[process_index]))), len(slices)
