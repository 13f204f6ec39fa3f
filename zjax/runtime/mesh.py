"""The device mesh (``data``, ``model``; ``replica`` for hybrid sharding, ``expert`` for
expert parallelism, ``context`` for sequence parallelism, ``node`` for ZeRO++'s hierarchical
partition) and CPU device simulation.

This module reads the process environment (``XLA_FLAGS``, ``PJRT_NPROC``) on purpose:
simulating devices must happen before jax initialises its backends.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zjax.errors import ConfigError
from zjax.runtime.config import MeshConfig

__all__ = [
    "CONTEXT",
    "DATA",
    "EXPERT",
    "MODEL",
    "NODE",
    "REPLICA",
    "MeshConfig",
    "batch_axes",
    "describe_axes",
    "describe_batch_split",
    "make_mesh",
    "process_batch_slice",
    "shard_axes",
    "simulate_cpu_devices",
    "simulated_device_env",
    "split_nodes",
    "token_axes",
]

DATA = "data"
MODEL = "model"
REPLICA = "replica"
NODE = "node"
CONTEXT = "context"
EXPERT = "expert"


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
    """Build the ``(data, model)`` mesh with automatic (GSPMD) axis types; ``replica`` > 1
    puts a ``replica`` axis first, ``expert`` > 1 an ``expert`` axis after ``data``,
    ``context`` > 1 a ``context`` axis after those.

    Args:
      config: axis sizes; ``-1`` takes all devices left.
      devices: devices to use (default: all of ``jax.devices()``).
    """
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    n, replica, context, expert = len(devices), config.replica, config.context, config.expert
    data, model = config.data, config.model
    others = [(k, v) for k, v in (("replica", replica), ("expert", expert),
                                  ("context", context)) if v > 1]
    rest = replica * context * expert

    def product(key: str, size: int) -> str:  # "mesh.model: 2 x mesh.context 4": the keys set
        named = ([(key, size)] if size > 1 or not others else []) + others
        return f"mesh.{named[0][0]}: {named[0][1]}" + "".join(f" x mesh.{k} {v}"
                                                             for k, v in named[1:])

    if data == -1:
        if n % (model * rest):
            raise ConfigError(f"{product('model', model)} does not divide the {n} devices")
        data = n // (model * rest)
    elif model == -1:
        if n % (data * rest):
            raise ConfigError(f"{product('data', data)} does not divide the {n} devices")
        model = n // (data * rest)
    sizes = {REPLICA: replica, DATA: data, EXPERT: expert, CONTEXT: context, MODEL: model}
    sizes = {k: v for k, v in sizes.items() if v > 1 or k in (DATA, MODEL)}
    total = int(np.prod(list(sizes.values())))
    if total != n:  # every size given: name each key and value, and the way out
        shape = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise ConfigError(f"mesh: {shape} = {total} does not equal the {n} devices; set "
                          "mesh.data (or mesh.model) to -1 to take what the other axes leave")
    shape, types = tuple(sizes.values()), (AxisType.Auto,) * len(sizes)
    try:
        return jax.make_mesh(shape, tuple(sizes), axis_types=types, devices=devices)
    except NotImplementedError:
        # a TPU torus whose physical axes no product of the logical sizes matches (data 8 x
        # expert 8 on 4x4x4): an axis spans parts of two physical ones, still a valid mesh
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, tuple(sizes), axis_types=types)


def describe_axes(mesh: Mesh, axes: str | tuple[str, ...] | None = None) -> str:
    """``mesh.data 4 x mesh.expert 2``: ``axes`` (default: every axis above 1, and ``data``)
    as the config keys that size them and their sizes, for messages. ZeRO++'s ``node`` x
    ``data`` split reads as the ``mesh.data`` it came from."""
    names = mesh.axis_names if axes is None else (axes,) if isinstance(axes, str) else axes
    sizes = {a: mesh.shape[a] for a in names
             if axes is not None or mesh.shape[a] > 1 or a == DATA}
    if NODE in sizes:  # hpZ: zero.hpz_partition_size groups of the data axis
        sizes[DATA] = sizes.pop(NODE) * sizes.get(DATA, 1)
    return " x ".join(f"mesh.{a} {v}" for a, v in sizes.items())


def describe_batch_split(mesh: Mesh) -> str:
    """The axes a global batch's rows are split over, for messages: ``data axis (8)``,
    ``data x expert axes (mesh.data 4 x mesh.expert 2 = 8)``; where the mesh has more axes
    (a derived ``data`` size), the whole of it too: ``data axis (3; the 6 devices are
    mesh.data 3 x mesh.context 2)``."""
    axes = batch_axes(mesh)
    axes = (axes,) if isinstance(axes, str) else axes
    names = list(dict.fromkeys(DATA if a == NODE else a for a in axes))
    n = int(np.prod([mesh.shape[a] for a in axes]))
    rows, whole = describe_axes(mesh, axes), describe_axes(mesh)
    inner = str(n) if len(names) == 1 else f"{rows} = {n}"
    if rows != whole:
        inner += f"; the {mesh.size} devices are {whole}"
    return f"{' x '.join(names)} {'axis' if len(names) == 1 else 'axes'} ({inner})"


def split_nodes(mesh: Mesh, group: int) -> Mesh:
    """``mesh`` with its ``data`` axis split into ``(node, data)``: groups of ``group``
    ``data`` devices of one process (a node's) keep the name ``data``; ``node`` numbers the
    groups. The ``data`` axis is first put in process order (a stable sort, so a mesh already
    laid out by process keeps its order).

    Raises:
      ConfigError: ``group`` does not divide the ``data`` axis, the mesh has a ``replica``
        axis, or a group spans processes.
    """
    names = mesh.axis_names
    n = mesh.shape[DATA]
    if REPLICA in names:
        raise ConfigError(
            f"zero.hpz_partition_size: {group} with mesh.replica: {mesh.shape[REPLICA]}: hybrid "
            "sharding already keeps the weight gathers inside a replica group; use one of them")
    for axis in (CONTEXT, EXPERT):
        if axis in names:
            raise ConfigError(
                f"zero.hpz_partition_size: {group} with mesh.{axis}: {mesh.shape[axis]}: ZeRO "
                f"shards over data x {axis} there; the hierarchical partition takes the data "
                "axis alone; use one of them")
    if group < 1 or n % group:
        raise ConfigError(f"zero.hpz_partition_size: {group} does not divide the data axis "
                          f"({n} devices); use a divisor of {n}, e.g. the devices per node")
    if group == n:  # one node: plain stage 3
        return mesh
    d = names.index(DATA)
    # the data axis in process order (stable): a mesh laid out by the interconnect's topology
    # (TPU) may interleave hosts along it, and a group must be one node's devices
    moved = np.moveaxis(mesh.devices, d, 0)
    order = sorted(range(n), key=lambda i: min(dev.process_index for dev in moved[i].flat))
    devices = np.moveaxis(moved[order], 0, d)
    devices = devices.reshape(*devices.shape[:d], n // group, group, *devices.shape[d + 1:])
    for idx in np.ndindex(devices.shape[:d + 1]):
        groups = devices[idx]
        procs = {dev.process_index for dev in groups.reshape(-1)}
        if len(procs) > 1:
            raise ConfigError(
                f"zero.hpz_partition_size: {group} puts devices of processes {sorted(procs)} "
                "in one secondary group; use the devices per process (or a divisor of it)")
    new_names = (*names[:d], NODE, *names[d:])
    return Mesh(devices, new_names, axis_types=(AxisType.Auto,) * len(new_names))


def batch_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The mesh axes a global batch's rows are split over: ``data``, or ``(replica, data)`` /
    ``(node, data)``, with ``expert`` after ``data`` where the mesh has it."""
    axes = [a for a in (REPLICA, NODE, DATA, EXPERT) if a in mesh.axis_names]
    return axes[0] if len(axes) == 1 else tuple(axes)


def token_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The mesh axes a global batch's tokens are split over: :func:`batch_axes` (the rows),
    and ``context`` (each row's sequence) where the mesh has it. A sum over the batch's
    tokens is a sum over these."""
    rows = batch_axes(mesh)
    if CONTEXT not in mesh.axis_names:
        return rows
    return (*(rows if isinstance(rows, tuple) else (rows,)), CONTEXT)


def shard_axes(mesh: Mesh, *, experts: bool = False) -> str | tuple[str, ...]:
    """The mesh axes ZeRO spreads a sharded leaf over: ``data``; ``(data, node)`` with
    ZeRO++'s hierarchical partition; ``(data, context)`` with a context axis (DeepSpeed-
    Ulysses' partition over the data x sequence group); ``expert`` too where the mesh has it,
    except for a leaf split over it (``experts``: a mixture's expert weights, sharded over
    the data devices that hold the same experts)."""
    if NODE in mesh.axis_names:
        return (DATA, NODE)
    axes = [a for a in (DATA, EXPERT, CONTEXT) if a in mesh.axis_names
            and not (experts and a == EXPERT)]
    return axes[0] if len(axes) == 1 else tuple(axes)


def process_batch_slice(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
    """Which of ``count`` equal slices of each global batch this process loads: ``(i, count)``.

    The batch is split over :func:`batch_axes` only, so processes whose devices sit at the
    same coordinates there (a ``model`` axis spanning processes) load the same slice.
    """
    process_index = jax.process_index() if process_index is None else process_index
    names = mesh.axis_names
    axes = batch_axes(mesh)
    axes = (axes,) if isinstance(axes, str) else axes
    sizes = tuple(mesh.shape[a] for a in axes)
    rows: dict[int, set] = {}
    for idx in np.ndindex(mesh.devices.shape):  # the row block: the batch axes' coordinates
        row = int(np.ravel_multi_index(tuple(idx[names.index(a)] for a in axes), sizes))
        rows.setdefault(mesh.devices[idx].process_index, set()).add(row)
    slices = sorted({tuple(sorted(r)) for r in rows.values()})
    flat = [i for s in slices for i in s]
    if len(flat) != len(set(flat)) or len({len(s) for s in slices}) != 1:
        shape = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
        raise ConfigError(
            f"mesh: {shape} gives the processes overlapping or unequal slices of the batch "
            f"({slices}); choose axis sizes whose data rows divide evenly among the processes"
        )
    return slices.index(tuple(sorted(rows[process_index]))), len(slices)
