"""Where the process meets devices: the mesh and CPU device simulation, joining a
``jax.distributed`` job and ``zjax launch``, compile-only accelerator targets (their compiles
kept beside JAX's cache), and one record per XLA backend of its compiler options and
workarounds.

It owns the ``mesh`` section (``zjax.runtime.config``) and the process environment that
decides devices (``XLA_FLAGS``, ``JAX_PLATFORMS``, the distributed variables). It imports only
``zjax.errors`` and ``zjax.schema``. Names load on first use, so reading a config does not
start JAX's backends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.runtime.config import MeshConfig

_LAZY = {
    "Backend": "zjax.runtime._backend",
    "CompiledFigures": "zjax.runtime._target_cache",
    "CONTEXT": "zjax.runtime.mesh",
    "EXPERT": "zjax.runtime.mesh",
    "DATA": "zjax.runtime.mesh",
    "ENV": "zjax.runtime.distributed",
    "GPU_TARGETS": "zjax.runtime.targets",
    "MODEL": "zjax.runtime.mesh",
    "NODE": "zjax.runtime.mesh",
    "ProcessSpec": "zjax.runtime.distributed",
    "Quirk": "zjax.runtime._backend",
    "REPLICA": "zjax.runtime.mesh",
    "TPU_HBM_BYTES": "zjax.runtime.targets",
    "Target": "zjax.runtime.targets",
    "backend": "zjax.runtime._backend",
    "backend_of": "zjax.runtime._backend",
    "batch_axes": "zjax.runtime.mesh",
    "compile_for_figures": "zjax.runtime._figures",
    "compile_for_target": "zjax.runtime._target_cache",
    "detect": "zjax.runtime.distributed",
    "initialize": "zjax.runtime.distributed",
    "launch": "zjax.runtime.launch",
    "make_mesh": "zjax.runtime.mesh",
    "process_batch_slice": "zjax.runtime.mesh",
    "held_stderr": "zjax.runtime._plugins",
    "quiet_plugins": "zjax.runtime._plugins",
    "write_stderr": "zjax.runtime._plugins",
    "simulate_cpu_devices": "zjax.runtime.mesh",
    "simulated_device_env": "zjax.runtime.mesh",
    "split_nodes": "zjax.runtime.mesh",
    "shard_axes": "zjax.runtime.mesh",
    "token_axes": "zjax.runtime.mesh",
    "target": "zjax.runtime.targets",
}

__all__ = [
    "CONTEXT",
    "DATA",
    "ENV",
    "EXPERT",
    "GPU_TARGETS",
    "MODEL",
    "NODE",
    "REPLICA",
    "TPU_HBM_BYTES",
    "Backend",
    "CompiledFigures",
    "MeshConfig",
    "ProcessSpec",
    "Quirk",
    "Target",
    "backend",
    "backend_of",
    "batch_axes",
    "compile_for_figures",
    "compile_for_target",
    "detect",
    "held_stderr",
    "initialize",
    "launch",
    "make_mesh",
    "process_batch_slice",
    "quiet_plugins",
    "shard_axes",
    "simulate_cpu_devices",
    "simulated_device_env",
    "split_nodes",
    "target",
    "token_axes",
    "write_stderr",
]


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from zjax.runtime._backend import Backend, Quirk, backend, backend_of
    from zjax.runtime._figures import compile_for_figures
    from zjax.runtime._plugins import held_stderr, quiet_plugins, write_stderr
    from zjax.runtime._target_cache import CompiledFigures, compile_for_target
    from zjax.runtime.distributed import ENV, ProcessSpec, detect, initialize
    from zjax.runtime.launch import launch
    from zjax.runtime.mesh import (
        CONTEXT,
        DATA,
        EXPERT,
        MODEL,
        NODE,
        REPLICA,
        batch_axes,
        make_mesh,
        process_batch_slice,
        shard_axes,
        simulate_cpu_devices,
        simulated_device_env,
        split_nodes,
        token_axes,
    )
    from zjax.runtime.targets import GPU_TARGETS, TPU_HBM_BYTES, Target, target
