"""``zjax launch``: P local processes of one ``jax.distributed`` job, for testing on one machine.

Each child gets ``ZJAX_COORDINATOR`` (loopback, a free port), ``ZJAX_NUM_PROCESSES``,
``ZJAX_PROCESS_ID`` and, with ``--devices-per-process D``, D simulated CPU devices. SIGINT and
SIGTERM are forwarded to every child. When a child fails, the others are ended (SIGTERM, then
SIGKILL after a grace period) and the launcher exits with the failing child's code; no child
outlives it. This module reads and extends the process environment for the children.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from zjax.errors import ConfigError
from zjax.runtime.distributed import ENV
from zjax.runtime.mesh import simulated_device_env

__all__ = ["launch"]

GRACE_S = 10.0
MAX_PROCESSES = 64  # local processes: a test of multi-process code, not a cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a shell reports


def _end(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(command: Sequence[str], *, processes: int, devices_per_process: int | None = None,
           port: int | None = None, grace_s: float = GRACE_S) -> int:
    """Run ``command`` as ``processes`` cooperating processes; return the job's exit code.

    Raises:
      ConfigError: a count below 1, no command, or a command that cannot be run (checked
        before any process starts).
    """
    if processes < 1:
        raise ConfigError(f"-n: must be >= 1, got {processes}")
    if processes > MAX_PROCESSES:
        raise ConfigError(
            f"-n: {processes} processes on one machine is more than zjax launch starts (at "
            f"most {MAX_PROCESSES}: each one loads JAX, hundreds of MB); launch runs a "
            "multi-process job on one machine for testing, a real one runs under its "
            "cluster's launcher (SLURM, Open MPI, or one zjax train per host)")
    if devices_per_process is not None and devices_per_process < 1:
        raise ConfigError(f"--devices-per-process: must be >= 1, got {devices_per_process}")
    if not command:
        raise ConfigError("zjax launch needs a command after --, e.g. -- zjax train CONFIG")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"command: {command[0]!r} is not an executable file"
                          f"{'' if os.sep in command[0] else ' on PATH'}; expected a program, "
                          "e.g. -- zjax train CONFIG")
    address = f"127.0.0.1:{port or _free_port()}"
    procs: list[subprocess.Popen] = []
    for i in range(processes):
        env = dict(os.environ)
        env.update({ENV["coordinator"]: address, ENV["num_processes"]: str(processes),
                    ENV["process_id"]: str(i)})
        if devices_per_process:
            env.update(simulated_device_env(devices_per_process, env))
            env["JAX_PLATFORMS"] = "cpu"
        try:
            procs.append(subprocess.Popen(list(command), env=env))
        except OSError as e:  # vanished or unrunnable since the check: end the ones started
            _end(procs, grace_s)
            raise ConfigError(f"command: cannot run {command[0]!r}: {e.strerror or e}") from None

    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                others = [p for p in procs if p.poll() is None]
                if others and not received:
                    print(f"zjax launch: a process exited with {_exit_code(failed)}; ending "
                          f"the other {len(others)}", file=sys.stderr, flush=True)
                _end(procs, grace_s)
                return _exit_code(failed)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        _end(procs, grace_s)
        for s, handler in previous.items():
            signal.signal(s, handler)
