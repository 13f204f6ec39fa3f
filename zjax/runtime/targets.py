"""Compile-only accelerator targets: the devices of a GPU node or a TPU slice, without hardware.

``zjax plan --target h100:8`` and :func:`zjax.plan` compile the train step for these devices
on a CPU-only machine (deviceless AOT), so memory and the scheduled collectives come from the
real compiler. GPU targets use the CUDA plugin (``jax-cuda12-plugin``/``jax-cuda12-pjrt``) with
the target specs shipped in ``zjax/target_specs`` (XLA's ``specs/h100_sxm.txtpb``; the H200 is
the same chip with 141 GB at 4.8 TB/s); TPU targets use libtpu's topologies. Both come with
``pip install 'zjax[targets]'``.

Names: ``h100:N`` / ``h200:N`` (N GPUs on one host), ``h100:HxN`` (H hosts of N), and TPU
topologies as libtpu names them (``v5p:2x2x2``, ``v5e:4x4``, ``v6e:2x4``, ``v4:2x2x1``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import logging
import re

from zjax.errors import ConfigError, did_you_mean
from zjax.runtime._plugins import held_stderr

__all__ = ["GPU_TARGETS", "TPU_HBM_BYTES", "Target", "target"]

log = logging.getLogger(__name__)

GPU_TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
# HBM per chip, from Google Cloud's TPU system architecture pages (v4: 32 GiB, v5e: 16 GiB,
# v5p: 95 GB, v6e Trillium: 32 GB); libtpu's compile-only devices report no memory size.
TPU_HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 10**9, "v6e": 32 * 10**9}
_EXAMPLES = "h100:8, h200:8, h100:2x8, v5p:2x2x2, v5e:4x4, v6e:2x4, v4:2x2x1"


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile-only accelerator target.

    Attributes:
      name: as given (``h100:8``, ``v5p:2x2x2``).
      platform: ``gpu`` or ``tpu``.
      devices: the compile-only devices (build a mesh of them; nothing runs on them).
      device_kind: the devices' kind (``NVIDIA H100 80GB HBM3``, ``TPU v5``).
      capacity_bytes: device memory per device.
      hosts: hosts (processes) the devices span.
    """

    name: str
    platform: str
    devices: tuple
    device_kind: str
    capacity_bytes: int
    hosts: int


def _bad(name: str, why: str) -> ConfigError:
    return ConfigError(f"--target: {name!r} {why}; valid targets look like {_EXAMPLES}")


def _need(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"--target: compiling for {what} needs {module}; install "
                          "zjax[targets] (pip install -e '.[targets]')")


def _gpu(name: str, chip: str, shape: str) -> Target:
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)", shape)
    if not m or int(m.group(2)) < 1 or (m.group(1) and int(m.group(1)) < 1):
        raise _bad(name, f"has no GPU count after '{chip}:' (N or HxN)")
    hosts, per_host = int(m.group(1) or 1), int(m.group(2))
    _need("jax_cuda12_plugin", "NVIDIA GPUs")
    from jax.experimental import topologies

    spec = importlib.resources.files("zjax.runtime").joinpath("target_specs", GPU_TARGETS[chip])
    text = spec.read_text()
    try:
        topo = topologies.get_topology_desc(topology_name="gpu", platform="cuda",
                                            target_config=text,
                                            topology=f"1x{hosts}x{per_host}")
    except NotImplementedError:  # the plugin failed its CUDA checks and did not register
        raise ConfigError(
            f"--target: {name!r} needs the CUDA plugin, which skipped registering: without a "
            "GPU it does so unless JAX runs with JAX_PLATFORMS=cpu (the zjax CLI sets it; "
            "in Python set it before importing jax, or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1)"
        ) from None
    capacity = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    devices = tuple(topo.devices)
    return Target(name, "gpu", devices, devices[0].device_kind, capacity, hosts)


def _quietly(call):
    """``call()`` with fd 2 held: libtpu writes start-up lines to fd 2 the first time it loads
    (``Failed to find host bounds``, ``E0000 ... unexpected worker hostname`` on a machine
    without a TPU), before its logging is set up: TPU_MIN_LOG_LEVEL, TPU_STDERR_LOG_LEVEL and
    TF_CPP_MIN_LOG_LEVEL do not silence them (measured with libtpu 0.0.42.1). The lines go to
    the ``zjax.runtime`` logger at DEBUG; only if ``call`` is stopped by something other than an
    Exception (an interrupt) are they written back to stderr."""
    with held_stderr(keep=lambda line: False):
        return call()


def _tpu(name: str, generation: str) -> Target:
    _need("libtpu", "TPUs")
    from jax.experimental import topologies

    try:
        topo = _quietly(lambda: topologies.get_topology_desc(topology_name=name,
                                                             platform="tpu"))
    except Exception as e:  # libtpu's own message says what shapes it takes
        first = str(e).splitlines()[0][:200]
        if "lockfile" in first:  # another process holds libtpu
            raise ConfigError(
                f"--target: {name!r}: another process has libtpu loaded ({first}); without a "
                "TPU, ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets several compile (the zjax CLI sets "
                "it when the machine has no accelerator)") from None
        raise _bad(name, f"is not a {generation} topology libtpu knows ({first})") from None
    devices = tuple(topo.devices)
    hosts = len({d.process_index for d in devices})
    return Target(name, "tpu", devices, devices[0].device_kind, TPU_HBM_BYTES[generation], hosts)


@functools.cache
def target(name: str) -> Target:
    """The compile-only devices of target ``name`` (``h100:8``, ``v5p:2x2x2``, ...).

    Raises:
      ConfigError: an unknown name or shape, or the compiler plugin is not installed.
    """
    chip, _, shape = name.partition(":")
    chip = chip.lower()
    if chip in GPU_TARGETS:
        return _gpu(name, chip, shape)
    if chip in TPU_HBM_BYTES:
        if not re.fullmatch(r"\d+(x\d+){1,2}", shape):
            raise _bad(name, f"has no topology after '{chip}:' (e.g. 2x2x2)")
        if 0 in [int(n) for n in shape.split("x")]:
            raise _bad(name, "has a dimension of 0 chips (each must be at least 1)")
        return _tpu(f"{chip}:{shape}", chip)
    known = [*GPU_TARGETS, *TPU_HBM_BYTES]
    raise _bad(name, f"names no known chip {chip!r}{did_you_mean(chip, known)} "
                     f"(known: {', '.join(known)})")

