"""The streamed step's traffic with the swap files: layers read ahead from the float32 master,
gradient shards written behind (and summed over micro-batches) until the update reads them.

A process reads only the distinct shards it holds (:class:`~zjax.step._nvme_engine.
LeafShards`), each layer of a stacked leaf a contiguous range of its shard's file (the layers
are the shard's leading axis: ZeRO never shards it here), cast on the host to the working dtype
and put on every device holding that shard.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zjax.errors import ConfigError
from zjax.offload import NvmeStore, sum_squares
from zjax.step._nvme import NvmeOptimizer
from zjax.step._nvme_engine import LeafShards
from zjax.step._stream_programs import Programs, layer_spec

__all__ = ["GradFiles", "LayerReader", "check_buffer", "layer_elements", "read_leaf"]

BUFFER_KEY = "zero.offload_param.buffer_size"


def _assemble(leaf: LeafShards, sharding: NamedSharding, shape: tuple[int, ...],
              hosts: list[np.ndarray]) -> jax.Array:
    """A global array laid out as ``sharding`` from each distinct shard's host values."""
    on: dict = {}
    for host, devices in zip(hosts, leaf.devices, strict=True):
        host = host.astype(leaf.stored, copy=False).reshape(sharding.shard_shape(shape))
        on.update({d: jax.device_put(host, d) for d in devices})
    order = list(sharding.addressable_devices_indices_map(shape))
    return jax.make_array_from_single_device_arrays(shape, sharding, [on[d] for d in order])


def read_leaf(engine: NvmeOptimizer, j: int) -> jax.Array:
    """Leaf ``j``'s working params, whole, from the master in the swap files."""
    leaf = engine.leaves[j]
    hosts = [engine.opt.store.read_now(f"{name}.master", 0, size)
             for name, size in zip(leaf.names, leaf.sizes, strict=True)]
    return _assemble(leaf, leaf.param, leaf.shape, hosts)


def _elements(engine: NvmeOptimizer, call) -> int:
    """Elements of this process's shards of one layer of ``call``."""
    return sum(s // call.n_layers for j in call.leaves for s in engine.leaves[j].sizes)


def layer_elements(engine: NvmeOptimizer, programs: Programs) -> int:
    """Elements of this process's shards of the largest layer (what one buffer holds)."""
    return max((_elements(engine, call) for call in programs.calls), default=0)


def check_buffer(engine: NvmeOptimizer, programs: Programs, buffer_size: int) -> None:
    """Raise unless every layer's shards on this process fit one buffer.

    Raises:
      ConfigError: naming ``zero.offload_param.buffer_size`` and the size needed.
    """
    for call in programs.calls:
        if (n := _elements(engine, call)) > buffer_size:
            raise ConfigError(
                f"{BUFFER_KEY}: one layer of {call.path} is {n:,} elements on this process, "
                f"over the buffer's {buffer_size:,}; raise it to at least {n:,} (or use "
                "more devices)")


class LayerReader:
    """Layers of the stacked leaves read from the master ``buffer_count`` layers ahead of the
    one asked for (the devices compute meanwhile: dispatch is asynchronous).

    Raises:
      ConfigError: a layer's shards on this process exceed ``buffer_size`` elements.
    """

    def __init__(self, engine: NvmeOptimizer, programs: Programs, *, buffer_count: int,
                 buffer_size: int):
        self.engine, self.programs, self.ahead = engine, programs, buffer_count
        plan = programs.plan
        self.shardings = [[NamedSharding(plan.mesh, layer_spec(plan.leaves[j]))
                           for j in call.leaves] for call in programs.calls]
        check_buffer(engine, programs, buffer_size)

    def _submit(self, c: int, i: int) -> list[list[Any]]:
        call, store = self.programs.calls[c], self.engine.opt.store
        out = []
        for j in call.leaves:
            leaf = self.engine.leaves[j]
            out.append([store.read(f"{name}.master", i * (size // call.n_layers),
                                   size // call.n_layers)
                        for name, size in zip(leaf.names, leaf.sizes, strict=True)])
        return out

    def layers(self, schedule: list[tuple[int, int]]) -> Iterator[list[jax.Array]]:
        """The shards of layer ``i`` of call ``c`` for each ``(c, i)`` of ``schedule``."""
        pending: collections.deque = collections.deque()
        for c, i in schedule[:self.ahead]:
            pending.append(self._submit(c, i))
        # the read buffers are not recycled: XLA:CPU's device_put takes page-aligned host
        # memory as the device array's own (no copy), for as long as the array lives
        for n, (c, _) in enumerate(schedule):
            futures = pending.popleft()
            if n + self.ahead < len(schedule):
                pending.append(self._submit(*schedule[n + self.ahead]))
            call, out = self.programs.calls[c], []
            for j, sharding, fs in zip(call.leaves, self.shardings[c], futures, strict=True):
                hosts = [f.result() for f in fs]
                out.append(_assemble(self.engine.leaves[j], sharding,
                                     self.engine.leaves[j].shape[1:], hosts))
            yield out


class GradFiles:
    """Each distinct gradient shard of this process in a swap file of its own (float32, the
    master's layout), written as the backward hands layers over; summed over micro-batches.

    Args:
      engine: the NVMe optimizer (its shards' names and sizes).
      path: ``nvme_path``.
      threads: writes in flight.
      key: the config key naming ``path``.
    """

    def __init__(self, engine: NvmeOptimizer, path: str, *, threads: int, key: str):
        self.engine = engine
        self.store = NvmeStore(path, engine.sizes, threads=threads, key=key)
        self.pending: collections.deque = collections.deque()
        self.threads, self.sumsq = threads, 0.0

    def put(self, j: int, g: jax.Array, *, layer: tuple[int, int] | None, first: bool,
            last: bool) -> None:
        """Write leaf ``j``'s gradient ``g`` (own shards; ``layer``: ``(i, n_layers)`` of a
        stacked leaf's layer ``i``), added to what is there unless ``first``; ``last``: the
        micro-batch whose sums are final (counted in :attr:`sumsq`)."""
        for name, start, values in self.summed(j, g, layer=layer, first=first, last=last):
            self.pending.append(self.store.write(name, start, values))
            while len(self.pending) > self.threads:
                self.pending.popleft().result()

    def summed(self, j: int, g: jax.Array, *, layer: tuple[int, int] | None, first: bool,
               last: bool) -> Iterator[tuple[str, int, np.ndarray]]:
        """``(name, start, float32 values)`` of each of leaf ``j``'s shards of ``g`` plus what
        the files hold unless ``first``; counted in :attr:`sumsq` if ``last`` (the
        arguments as in :meth:`put`)."""
        leaf = self.engine.leaves[j]
        on = {s.device: s.data for s in g.addressable_shards}
        for name, size, devices, owned in zip(leaf.names, leaf.sizes, leaf.devices,
                                               leaf.owned, strict=True):
            n = size if layer is None else size // layer[1]
            start = 0 if layer is None else layer[0] * n
            values = np.asarray(on[devices[0]], np.float32).reshape(-1)
            if not first:
                self.flush()  # an earlier micro-batch's write of this range must have landed
                values = values + self.store.read_now(name, start, n)
            if last and owned:
                self.sumsq += sum_squares(values)
            yield name, start, values

    def flush(self) -> None:
        """Wait for every write in flight."""
        while self.pending:
            self.pending.popleft().result()

    def source(self, name: str) -> _Slices:
        """Shard ``name``'s gradient, read by element range (the update's input)."""
        return _Slices(self.store, name)

    def close(self) -> None:
        self.flush()
        self.store.close()


class _Slices:
    def __init__(self, store: NvmeStore, name: str):
        self.store, self.name = store, name

    def __getitem__(self, s: slice) -> np.ndarray:
        return self.store.read_now(self.name, s.start, s.stop - s.start)
