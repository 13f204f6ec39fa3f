"""The device side of the NVMe optimizer: which shards a process streams, and the working
params rebuilt on the devices from the streamed master.

Each param leaf's float32 master and optimizer state are split as the plan's ``state_specs``
say (each device's own shard). A process streams each distinct shard it holds once (devices
that hold the same shard, a replica over ``model`` or ``replica``, share it), in swap files
named ``<leaf>.<shard>``. The gradients come from the device a sub-group at a time; the new
master values go back to every device holding that shard, written in place into a fresh
buffer of the working dtype, and each finished leaf is laid out as the step takes it
(all-gathered at stages 0-2, moved to host memory with ``offload_param: host``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

__all__ = ["LeafShards", "ParamBuilder", "Slices", "leaf_shards", "local_value"]


def local_value(x: Any) -> np.ndarray:
    """The value of a replicated array from this process's first shard (a global array may
    span other processes' devices, which ``float(x)`` refuses)."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


class LeafShards(NamedTuple):
    """One param leaf as the NVMe optimizer streams it.

    Attributes:
      shape: the leaf's global shape.
      state: its own-shard float32 sharding (the master's and optimizer state's layout).
      param: the sharding the step takes its working copy in.
      stored: the working copy's dtype.
      names: swap-file names of the distinct shards this process holds, in order
        (``p<process>.<leaf>.<shard>``: processes sharing a directory never share a file).
      devices: for each name, this process's devices that hold that shard.
      sizes: for each name, the shard's elements.
      owned: for each name, whether this process counts it in global sums (one process
        does for each shard, so a sum over processes counts every shard once).
    """

    shape: tuple[int, ...]
    state: NamedSharding
    param: NamedSharding
    stored: np.dtype
    names: list[str]
    devices: list[list[jax.Device]]
    sizes: list[int]
    owned: list[bool]


def _key(index: tuple[slice, ...], shape) -> tuple:
    return tuple((s.start or 0, shape[i] if s.stop is None else s.stop)
                 for i, s in enumerate(index))


def leaf_shards(i: int, shape, state: NamedSharding, param: NamedSharding,
                stored: np.dtype) -> LeafShards:
    """The distinct shards of leaf ``i`` that this process holds, by ``state``'s layout."""
    shape = tuple(shape)
    groups: dict[tuple, list[jax.Device]] = {}
    for device, index in state.addressable_devices_indices_map(shape).items():
        groups.setdefault(_key(index, shape), []).append(device)
    first: dict[tuple, int] = {}  # the lowest device id holding each shard, over all processes
    for device, index in state.devices_indices_map(shape).items():
        k = _key(index, shape)
        first[k] = min(first.get(k, device.id), device.id)
    keys = list(groups)
    process = jax.process_index()
    return LeafShards(
        shape, state, param, np.dtype(stored),
        [f"p{process}.{i}.{k}" for k in range(len(keys))],
        [groups[k] for k in keys],
        [int(np.prod([b - a for a, b in k], dtype=np.int64)) for k in keys],
        [any(d.id == first[k] for d in groups[k]) for k in keys])


@functools.lru_cache(maxsize=64)
def _slice(n: int) -> Callable:
    return jax.jit(lambda x, start: lax.dynamic_slice(x.reshape(-1), (start,), (n,)))


@functools.lru_cache(maxsize=64)
def _update_slice(n: int) -> Callable:
    del n  # one cache entry per piece size; the jit retraces per buffer shape itself

    def put(buf, piece, start):
        return lax.dynamic_update_slice(buf.reshape(-1), piece, (start,)).reshape(buf.shape)

    return jax.jit(put, donate_argnums=0)


class Slices:
    """``x[a:b]`` of a single-device array's flattened elements, fetched to host memory: a
    gradient or master shard read a sub-group at a time."""

    def __init__(self, x: jax.Array):
        self.x = x

    def __getitem__(self, s: slice) -> np.ndarray:
        return np.asarray(_slice(s.stop - s.start)(self.x, np.int32(s.start)))


def shard_data(x: jax.Array, leaf: LeafShards) -> Iterator[tuple[str, jax.Array]]:
    """``(name, single-device array)`` of each distinct shard of ``x`` (laid out as
    ``leaf.state``) that this process holds."""
    on = {s.device: s.data for s in x.addressable_shards}
    for name, devices in zip(leaf.names, leaf.devices, strict=True):
        yield name, on[devices[0]]


class ParamBuilder:
    """Builds the new working params from the streamed master, a sub-group at a time.

    ``put(name, start, values)`` writes a sub-group's new float32 master values, cast to the
    working dtype, into each device that holds the shard; a leaf is laid out as the step
    takes it once all its shards are complete. ``sumsq`` adds up the squares of the values of
    the shards this process owns (a param norm).
    """

    def __init__(self, leaves: list[LeafShards]):
        self.leaves = leaves
        self.where = {name: (j, k) for j, leaf in enumerate(leaves)
                      for k, name in enumerate(leaf.names)}
        self.remaining = [sum(leaf.sizes) for leaf in leaves]
        self.buffers: dict[tuple[int, jax.Device], jax.Array] = {}
        self.done: list[jax.Array | None] = [None] * len(leaves)
        self.sumsq = 0.0

    def put(self, name: str, start: int, values: np.ndarray) -> None:
        j, k = self.where[name]
        leaf = self.leaves[j]
        if leaf.owned[k]:
            self.sumsq += float(np.vdot(values, values))  # a metric: float32 sums suffice
        piece = values.astype(leaf.stored)
        shard_shape = leaf.state.shard_shape(leaf.shape)
        for device in leaf.devices[k]:
            buf = self.buffers.get((j, device))
            if buf is None:
                buf = jnp.zeros(shard_shape, leaf.stored, device=device)
            self.buffers[(j, device)] = _update_slice(values.size)(
                buf, jax.device_put(piece, device), np.int32(start))
        self.remaining[j] -= values.size  # once per shard, whatever its replicas
        if self.remaining[j] == 0:
            self._finish(j)

    def _finish(self, j: int) -> None:
        leaf = self.leaves[j]
        devices = list(leaf.state.addressable_devices_indices_map(leaf.shape))
        x = jax.make_array_from_single_device_arrays(
            leaf.shape, leaf.state, [self.buffers.pop((j, d)) for d in devices])
        # stages 0-2 all-gather the working copy; offload_param: host moves it to host memory
        self.done[j] = x if leaf.param == leaf.state else jax.device_put(x, leaf.param)

    def result(self) -> list[jax.Array]:
        """The new working param of every leaf (all shards must have been put)."""
        missing = [j for j, x in enumerate(self.done) if x is None]
        if missing:
            raise RuntimeError(f"the NVMe stream left leaves {missing[:5]} incomplete")
        return list(self.done)
