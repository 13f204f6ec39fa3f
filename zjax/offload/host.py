"""Memory-kind placement of offloaded state, and the moves inside the step.

Between steps an offloaded array lives in host memory: its ``NamedSharding`` carries
``memory_kind="pinned_host"`` (or ``unpinned_host``), and the jitted step takes and returns it
there through its in/out shardings. Inside the step :func:`to_device` / :func:`to_host` move
values by memory space (``jax.device_put`` with ``jax.memory.Space``); on GPU and TPU XLA turns
them into host<->device copies. XLA:CPU has one memory, so there the moves compile to nothing and
only the placement of the step's arguments and results (``S(5)`` in its entry layout) shows them.
:func:`global_norm` is a norm that, unlike optax's, also runs on host-memory values.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zjax.errors import ConfigError

__all__ = ["check_memory_kind", "global_norm", "on_host", "on_host_compute", "to_device",
           "to_host"]

_IS_SHARDING = lambda x: isinstance(x, NamedSharding)


def check_memory_kind(mesh: Mesh, kind: str, *, key: str) -> None:
    """Raise ConfigError naming ``key`` if arrays cannot be placed in ``kind`` memory on ``mesh``.

    JAX keeps a sharding's memory kind only for devices that list that memory; for devices
    that list none (compile-only GPU devices of a deviceless target, jaxlib 0.10) it silently
    drops it, so the placement would not happen.
    """
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    placed = NamedSharding(mesh, PartitionSpec()).with_memory_kind(kind).memory_kind
    if kind in kinds and placed == kind:
        return
    if not kinds:
        raise ConfigError(
            f"{key}: JAX cannot place arrays in {kind!r} memory on these {device.platform} "
            f"devices ({device.device_kind}): compile-only devices of a deviceless GPU target "
            "list no memories, and JAX drops the memory kind of their shardings. Offload runs "
            "on real GPUs; plan it on a TPU target (v5p:2x2x2) or on CPU devices")
    raise ConfigError(f"{key}: this backend ({device.platform}) has no "
                      f"{kind!r} memory; it has {', '.join(sorted(kinds))}")


def on_host(shardings: Any, kind: str = "pinned_host") -> Any:
    """The same shardings in host memory of ``kind``."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings, is_leaf=_IS_SHARDING)


def to_device(tree: Any) -> Any:
    """Move every array of ``tree`` to device memory (a no-op for those already there)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def to_host(tree: Any) -> Any:
    """Move every array of ``tree`` to host memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def on_host_compute(enabled: bool):
    """``compute_on("device_host")`` when ``enabled``, else a null context."""
    return compute_on("device_host") if enabled else contextlib.nullcontext()


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of ``tree``, computable on host-memory values.

    ``optax.tree.norm`` adds each leaf's ``.imag``, a zero created in device memory, which JAX
    refuses to mix with host-memory values under ``compute_on("device_host")``.
    """
    return jnp.sqrt(functools.reduce(
        operator.add, [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)]))
