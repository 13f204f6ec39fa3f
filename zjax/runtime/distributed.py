"""Multi-process runs on JAX's own distributed runtime (``jax.distributed``).

This module reads the process environment. A process learns that it is one of several from,
in order: explicit arguments (the CLI's ``--coordinator/--num-processes/--process-id``), the
``ZJAX_COORDINATOR`` / ``ZJAX_NUM_PROCESSES`` / ``ZJAX_PROCESS_ID`` variables (what ``zjax
launch`` sets), or a cluster JAX detects itself (SLURM, Open MPI). ``jax.distributed`` then
connects the processes; zjax adds nothing to the runtime, only a bounded, clear failure when
the coordinator cannot be reached (the runtime itself aborts the process after its deadline).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from zjax.errors import ConfigError

__all__ = ["ENV", "ProcessSpec", "detect", "initialize"]

ENV = {"coordinator": "ZJAX_COORDINATOR", "num_processes": "ZJAX_NUM_PROCESSES",
       "process_id": "ZJAX_PROCESS_ID"}
_CLUSTERS = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a multi-process job (None fields: JAX detects them)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    source: str = "arguments"


def _int(value: str | int | None, key: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None


def detect(*, coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None) -> ProcessSpec | None:
    """The multi-process job this process belongs to, or None when it runs alone."""
    if coordinator or num_processes is not None or process_id is not None:
        return _checked(ProcessSpec(coordinator, num_processes, process_id, "arguments"))
    env = {k: os.environ.get(v) for k, v in ENV.items()}
    if any(env.values()):
        spec = ProcessSpec(env["coordinator"], _int(env["num_processes"], ENV["num_processes"]),
                           _int(env["process_id"], ENV["process_id"]), "ZJAX_* variables")
        return _checked(spec)
    for var, name in _CLUSTERS.items():
        if (_int(os.environ.get(var), var) or 1) > 1:
            return ProcessSpec(source=name)  # jax.distributed detects the rest itself
    return None


def _checked(spec: ProcessSpec) -> ProcessSpec:
    missing = [k for k in ("coordinator", "num_processes", "process_id")
               if getattr(spec, k) is None]
    if missing:
        raise ConfigError(f"distributed ({spec.source}): {', '.join(missing)} not given; a "
                          "multi-process run needs the coordinator address, the number of "
                          "processes and this process's id")
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise ConfigError(f"distributed ({spec.source}): process id {spec.process_id} is not in"
                          f" 0..{spec.num_processes - 1}")
    if ":" not in spec.coordinator:
        raise ConfigError(f"distributed ({spec.source}): coordinator {spec.coordinator!r} is "
                          "not HOST:PORT")
    return spec


def _wait_for(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"mesh.init_timeout_s: the coordinator {address} could not be reached "
                    f"within {timeout_s:g} s ({e.strerror or e}); is process 0 running, and "
                    "is the address right?") from None
            time.sleep(0.5)


def initialize(mode: str, spec: ProcessSpec | None, *, timeout_s: int) -> bool:
    """Join the multi-process job ``spec`` (see :func:`detect`) per ``mesh.distributed``.

    Args:
      mode: ``auto`` (join when ``spec`` says so), ``on`` (a job is required) or ``off``.
      spec: the job, or None when this process runs alone.
      timeout_s: how long to wait for the coordinator.

    Returns:
      Whether this process is part of a multi-process job.
    """
    if mode == "off":
        return False
    import jax  # here, not at the top: the CLI reads ENV before jax may start

    if jax.distributed.is_initialized():
        return True
    if spec is None:
        if mode == "on":
            raise ConfigError("mesh.distributed: 'on' but no multi-process job found: give "
                              "--coordinator/--num-processes/--process-id, ZJAX_* variables, "
                              "or run under SLURM / Open MPI")
        return False
    if spec.coordinator and spec.process_id:  # process 0 serves; the others must reach it
        _wait_for(spec.coordinator, timeout_s)
    jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                               initialization_timeout=timeout_s)
    return True
