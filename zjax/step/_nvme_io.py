"""The NVMe optimizer's state in and out of a checkpoint, one canonical leaf at a time.

A checkpoint holds the canonical tree (``{"step", "params", "opt_state"}``, float32 master and
the optax state, global shapes), whatever the offload: the NVMe run's checkpoint restores onto
a run in device memory and the other way round. Here each leaf is built from the swap files
(the shards this process holds, one leaf in memory at a time) or written into them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zjax.errors import NvmeError
from zjax.step._nvme import NvmeOptimizer
from zjax.step._nvme_engine import LeafShards, Slices, local_value, shard_data
from zjax.step._state import TrainState
from zjax.step._storage import Keys, Reader, path_keys

__all__ = ["NvmeStorage", "canonical_leaves", "restore_canonical"]


@functools.lru_cache(maxsize=8)
def _sum_squares(replicated) -> Callable:
    """One compiled sum of squares (replicated result) for every leaf, not one per leaf."""
    return jax.jit(lambda m: jnp.sum(jnp.square(m)), out_shardings=replicated)


def _what(engine: NvmeOptimizer, canonical: dict) -> Iterator[tuple[tuple[str, ...], Any, tuple]]:
    """``(keys, abstract leaf, (part, index))`` of each canonical leaf: part ``step``,
    ``master``, ``m<k>`` (index: the param leaf) or ``scalar`` (index: the count)."""
    entries = iter(engine.state_map.entries)
    j = 0
    for path, a in jax.tree_util.tree_flatten_with_path(canonical)[0]:
        keys = path_keys(path)
        if keys[0] == "step":
            yield keys, a, ("step", 0)
        elif keys[0] == "params":
            yield keys, a, ("master", j)
            j += 1
        else:
            yield keys, a, next(entries)


def _from_files(engine: NvmeOptimizer, leaf: LeafShards, part: str) -> jax.Array:
    """A leaf's ``part`` as a global array laid out as ``leaf.state``, read from the files."""
    shard_shape = leaf.state.shard_shape(leaf.shape)
    on: dict = {}
    for name, devices in zip(leaf.names, leaf.devices, strict=True):
        host = engine.opt.read(name, part).reshape(shard_shape)
        on.update({d: jax.device_put(host, d) for d in devices})
        del host
    devices = list(leaf.state.addressable_devices_indices_map(leaf.shape))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.state,
                                                    [on[d] for d in devices])


def canonical_leaves(engine: NvmeOptimizer, state: TrainState, canonical: dict
                     ) -> Iterator[tuple[tuple[str, ...], jax.Array]]:
    """``(keys, global array)`` of every canonical leaf of ``state``, each built when asked
    for (the master and moments from the swap files, the counts from the host)."""
    step = int(local_value(state.step))
    if engine.torn:
        raise NvmeError(f"saving step {step}: the NVMe swap files were left mid-update "
                        f"({engine.torn}); resume from the last checkpoint")
    if step != engine.step:
        raise RuntimeError(f"saving step {step}, but the NVMe swap files hold step "
                           f"{engine.step}")
    for keys, a, (part, i) in _what(engine, canonical):
        if part == "step":
            yield keys, state.step
        elif part == "scalar":
            yield keys, jax.device_put(np.asarray(engine.opt.scalars[i], a.dtype), a.sharding)
        else:
            yield keys, _from_files(engine, engine.leaves[i], part)


def restore_canonical(engine: NvmeOptimizer, canonical: dict,
                      read: Callable[[tuple[str, ...], jax.ShapeDtypeStruct], jax.Array]
                      ) -> TrainState:
    """Fill fresh swap files from a checkpoint, one leaf at a time: ``read(keys, target)``
    returns the leaf ``keys`` laid out as ``target``. Returns the state on the devices."""
    engine.check_shards()  # each leaf passes through the devices whole, sliced there
    opt = engine.open()
    params, scalars = [None] * len(engine.leaves), list(opt.scalars)
    step, sumsq = 0, 0.0
    for keys, a, (part, i) in _what(engine, canonical):
        x = read(keys, a)
        if part == "step":
            step = int(local_value(x))
        elif part == "scalar":
            scalars[i] = local_value(x)
        else:
            leaf = engine.leaves[i]
            for name, data in shard_data(x, leaf):
                opt.write(name, part, Slices(data))
            if part == "master":
                sumsq += float(local_value(_sum_squares(engine.replicated)(x)))
                if engine.keep_params:
                    params[i] = jax.device_put(x.astype(leaf.stored), leaf.param)
        del x
    opt.scalars = scalars
    engine.param_norm = float(np.sqrt(sumsq))
    return engine.started(jax.tree.unflatten(engine.treedef, params)
                          if engine.keep_params else None, step)


@dataclasses.dataclass(frozen=True)
class NvmeStorage:
    """State in the NVMe optimizer's swap files (``zero.offload_optimizer.device: nvme``):
    each canonical leaf is built from the files when asked for, or written into fresh ones."""

    canonical: dict
    engine: NvmeOptimizer
    resident: bool = False

    def leaves(self, state: TrainState) -> Iterator[tuple[Keys, jax.Array]]:
        return canonical_leaves(self.engine, state, self.canonical)

    def restore(self, read: Reader) -> TrainState:
        return restore_canonical(self.engine, self.canonical, read)
