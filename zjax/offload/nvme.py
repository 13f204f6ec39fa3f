"""The optimizer on NVMe (ZeRO-Infinity's third tier): float32 master params and optax moments
in swap files, updated on the host by sub-groups, streamed.

:class:`StreamingOptimizer` holds no state array whole in memory. An update walks every
array in sub-groups of ``sub_group_size`` elements: it reads a sub-group's master and moments
(``buffer_count`` sub-groups read ahead), runs the optax update on it (jitted for the host),
writes the new values back (``buffer_count`` writes in flight) and hands the new working
params to a sink. Reads of the next sub-groups and writes of the previous ones overlap the
update of the current one.

The optax transform must be elementwise: every per-parameter state leaf updated from the same
elements of the gradient, params and state (Adam, AdamW, SGD, their schedules and weight
decay). A global statistic (``clip_by_global_norm``) is computed beforehand, where the
gradients are whole, and passed as ``grad_scale``.
"""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zjax.errors import ConfigError
from zjax.offload._nvme_store import NvmeStore

__all__ = ["StreamStats", "StreamingOptimizer", "Update", "check_elementwise", "sum_squares"]

Sliceable = object  # anything with ``x[a:b]`` convertible by ``np.asarray``: numpy, jax, memmap
_SQUARES_CHUNK = 1 << 16


def sum_squares(values: np.ndarray) -> float:
    """The sum of squares of a float32 vector: float32 dot products of 65,536-element pieces
    summed in float64 (relative error ~1e-7 at billions of elements; a whole float64 copy
    costs ten times the time, and the streamed step does this for every gradient and
    parameter each step)."""
    v = np.ascontiguousarray(values, np.float32).reshape(-1)
    return math.fsum(float(np.dot(v[a:a + _SQUARES_CHUNK], v[a:a + _SQUARES_CHUNK]))
                     for a in range(0, v.size, _SQUARES_CHUNK))


def check_elementwise(tx: optax.GradientTransformation) -> None:
    """Raise if ``tx`` is not elementwise: its update of a vector must equal the updates of
    the vector's halves (a global-norm clip, for one, scales by the norm of what it sees).

    Raises:
      ConfigError: naming what differs.
    """
    rng = np.random.default_rng(0)
    params = rng.standard_normal(16).astype(np.float32)
    # two steps whose norms differ between the halves, so that a scale-free update (Adam)
    # still sees a global statistic through the ratio of one step's scaling to the next
    grads = [(rng.standard_normal(16) * 1e3).astype(np.float32),
             (rng.standard_normal(16) * np.repeat([1e3, 1e-3], 8)).astype(np.float32)]

    def run(s: slice) -> np.ndarray:
        p, state, out = params[s], tx.init(params[s]), []
        for g in grads:
            u, state = tx.update(g[s], state, p)
            out.append(np.asarray(u))
        return np.concatenate(out)

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        whole = run(slice(0, 16)).reshape(2, 16)
        halves = np.concatenate([run(slice(0, 8)).reshape(2, 8), run(slice(8, 16)).reshape(2, 8)],
                                axis=1)
    if not np.allclose(whole, halves, rtol=1e-4, atol=0):
        raise ConfigError(
            "the optimizer is not elementwise (an update depends on more than its own "
            "elements, e.g. clip_by_global_norm): the NVMe optimizer updates sub-groups "
            "apart; take the global statistic out of the transform and pass it as grad_scale")


class _Chunk:
    """The optax update of one sub-group, jitted for the host (once per sub-group length); the
    state's leaves split into per-parameter ones (moments, files) and the rest (step counts,
    kept in memory)."""

    def __init__(self, tx: optax.GradientTransformation, size: int, device):
        template = tx.init(jnp.zeros((size,), jnp.float32))
        leaves, self.treedef = jax.tree.flatten(template)
        self.moment = [np.shape(x) == (size,) for x in leaves]
        for x, m in zip(leaves, self.moment, strict=True):
            if not m and np.size(x) > 1:
                raise ConfigError(f"an optimizer state leaf of shape {np.shape(x)} is neither "
                                  "per-parameter nor a scalar: not an elementwise optimizer")
        self.n_moments = sum(self.moment)
        self.scalars = [np.asarray(x) for x, m in zip(leaves, self.moment, strict=True) if not m]

        def update(grad, master, moments, scalars, scale):
            it_m, it_s = iter(moments), iter(scalars)
            state = jax.tree.unflatten(self.treedef, [next(it_m) if m else next(it_s)
                                                      for m in self.moment])
            updates, state = tx.update(grad * scale, state, master)
            leaves = jax.tree.leaves(state)
            master = optax.apply_updates(master, updates)
            moments = [x for x, m in zip(leaves, self.moment, strict=True) if m]
            # finiteness here, fused with the update: a pass over the host arrays per part
            # would cost as much as the update itself
            finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in [master, *moments]]))
            return (master, moments, [x for x, m in zip(leaves, self.moment, strict=True)
                                      if not m], finite)

        def init(master):
            leaves = jax.tree.leaves(tx.init(master))
            return [x for x, m in zip(leaves, self.moment, strict=True) if m]

        self.device = device
        self._fn, self._init = jax.jit(update), jax.jit(init)

    def fn(self, *args):
        with jax.default_device(self.device):  # on the host, whatever the default backend
            return self._fn(*args)

    def init(self, master):
        with jax.default_device(self.device):
            return self._init(master)


class StreamStats(NamedTuple):
    """What one streamed update did.

    Attributes:
      finite: every new master value and optimizer state value is finite.
      seconds: wall time of the update (reads, host updates, writes).
      read_bytes: bytes read from the swap files.
      written_bytes: bytes written to them.
    """

    finite: bool
    seconds: float
    read_bytes: int
    written_bytes: int


class StreamingOptimizer:
    """Float32 master params and their optimizer state in swap files, updated by streaming.

    Args:
      tx: an elementwise optax transform (see the module docstring).
      sizes: elements of each flat array (a device's shard of a leaf), by name.
      path: the directory of the swap files (``nvme_path``).
      sub_group_size: elements updated at once (DeepSpeed's ``sub_group_size``).
      buffer_count: sub-groups read ahead, and writes in flight.
      key: the config key naming ``path`` (for errors).
    """

    def __init__(self, tx: optax.GradientTransformation, sizes: Mapping[str, int],
                 path: str | os.PathLike, *, sub_group_size: int = 1 << 20,
                 buffer_count: int = 4, key: str = "nvme_path"):
        if sub_group_size < 1 or buffer_count < 1:
            raise ValueError(f"sub_group_size {sub_group_size}, buffer_count {buffer_count}: "
                             "both must be >= 1")
        self.sub = max(1, int(min(sub_group_size, max(sizes.values(), default=1))))
        self.buffer_count = buffer_count
        check_elementwise(tx)
        self._chunk = _Chunk(tx, self.sub, jax.local_devices(backend="cpu")[0])
        self.scalars = self._chunk.scalars
        self.sizes = dict(sizes)
        files = {f"{name}.{part}": size for name, size in self.sizes.items()
                 for part in self.parts}
        self.store = NvmeStore(path, files, threads=buffer_count, key=key)

    @property
    def parts(self) -> list[str]:
        """The files of one array: its master and each per-parameter state leaf."""
        return ["master", *(f"m{i}" for i in range(self._chunk.n_moments))]

    @property
    def nbytes(self) -> int:
        """Bytes of the swap files."""
        return self.store.nbytes

    def _groups(self):
        for name, size in self.sizes.items():
            for start in range(0, size, self.sub):
                yield name, start, min(self.sub, size - start)

    def write_initial(self, params: Mapping[str, Sliceable], *, partial: bool = False) -> None:
        """Write the master params and their fresh optimizer state (``tx.init`` of each
        sub-group), sub-group by sub-group; ``partial``: only the arrays ``params`` names
        (the rest written by other calls)."""
        pending: collections.deque = collections.deque()
        for name, start, n in self._groups():
            if partial and name not in params:
                continue
            master = np.asarray(params[name][start:start + n], np.float32)
            moments = self._chunk.init(master)
            for part, values in zip(self.parts, [master, *moments], strict=True):
                pending.append(self.store.write(f"{name}.{part}", start,
                                                np.asarray(values)[:n]))
            while len(pending) > self.buffer_count * len(self.parts):
                pending.popleft().result()
        for f in pending:
            f.result()

    def write_initial_at(self, name: str, start: int, values: Sliceable) -> None:
        """Write ``values`` as array ``name``'s master from element ``start`` on, with their
        fresh optimizer state, sub-group by sub-group (one layer of a stacked leaf)."""
        size = len(values)
        pending: collections.deque = collections.deque()
        for a in range(0, size, self.sub):
            n = min(self.sub, size - a)
            master = np.asarray(values[a:a + n], np.float32)
            for part, v in zip(self.parts, [master, *self._chunk.init(master)], strict=True):
                pending.append(self.store.write(f"{name}.{part}", start + a, np.asarray(v)[:n]))
            while len(pending) > self.buffer_count * len(self.parts):
                pending.popleft().result()
        for f in pending:
            f.result()

    def _read(self, name: str, start: int, n: int):
        return [self.store.read(f"{name}.{part}", start, n) for part in self.parts]

    def update(self, grads: Mapping[str, Sliceable],
               sink: Callable[[str, int, np.ndarray], None] | None = None, *,
               grad_scale: float = 1.0) -> StreamStats:
        """One optimizer step over every array, streamed by sub-group.

        Args:
          grads: the gradient of each array (sliced by sub-group, read once).
          sink: ``sink(name, start, new_master_values)`` receives the new master params of
            each sub-group (to cast and send to the device); None discards them.
          grad_scale: multiplies every gradient first (a global clipping factor).

        Returns:
          :class:`StreamStats`.
        """
        run = self.begin(grad_scale=grad_scale)
        run.ranges([(name, 0, size) for name, size in self.sizes.items()],
                   lambda name, start, n: np.asarray(grads[name][start:start + n], np.float32),
                   sink)
        return run.finish()

    def begin(self, *, grad_scale: float = 1.0) -> Update:
        """An optimizer step taken range by range as the gradients arrive
        (:meth:`Update.ranges`; every element of every array exactly once), ended by
        :meth:`Update.finish`. Every range is updated with the state's scalars (step counts)
        as they were at ``begin``."""
        return Update(self, grad_scale)

    def write(self, name: str, part: str, values: Sliceable) -> None:
        """Set one array's ``part`` from ``values`` (sliced by sub-group: a checkpoint's
        restore), ``buffer_count`` writes in flight."""
        pending: collections.deque = collections.deque()
        for start in range(0, self.sizes[name], self.sub):
            n = min(self.sub, self.sizes[name] - start)
            chunk = np.asarray(values[start:start + n], np.float32)
            pending.append(self.store.write(f"{name}.{part}", start, chunk))
            while len(pending) > self.buffer_count:
                pending.popleft().result()
        for f in pending:
            f.result()

    def read(self, name: str, part: str = "master") -> np.ndarray:
        """One array's ``part`` (``master``, ``m0``, ...) whole: for tests and export."""
        return self.store.read_now(f"{name}.{part}", 0, self.sizes[name])

    def close(self, *, remove: bool = True) -> None:
        """Close (and by default delete) the swap files."""
        self.store.close(remove=remove)


class Update:
    """One optimizer step of a :class:`StreamingOptimizer` in progress: ranges of its arrays
    updated as their gradients arrive, each read ``buffer_count`` sub-groups ahead and
    written behind (writes stay in flight from one call to the next)."""

    def __init__(self, opt: StreamingOptimizer, grad_scale: float):
        self.opt, self.scale = opt, np.float32(grad_scale)
        store = opt.store
        self._t0, self._read0, self._written0 = (time.perf_counter(), store.read_bytes,
                                                 store.written_bytes)
        self._writes: collections.deque = collections.deque()
        self._before = list(opt.scalars)  # every range steps from these
        self._scalars = self._before
        self.finite = True

    def ranges(self, ranges: list[tuple[str, int, int]],
               grad: Callable[[str, int, int], np.ndarray],
               sink: Callable[[str, int, np.ndarray], None] | None = None) -> None:
        """Update elements ``start .. start + count`` of array ``name`` for each
        ``(name, start, count)``: ``grad(name, start, n)`` gives a sub-group's float32
        gradient, ``sink`` receives its new master values (as in
        :meth:`StreamingOptimizer.update`)."""
        opt, sub = self.opt, self.opt.sub
        groups = [(name, a, min(sub, start + count - a)) for name, start, count in ranges
                  for a in range(start, start + count, sub)]
        reads = collections.deque(opt._read(*g) for g in groups[:opt.buffer_count])
        for j, (name, start, n) in enumerate(groups):
            master, *moments = (f.result() for f in reads.popleft())
            if j + opt.buffer_count < len(groups):
                reads.append(opt._read(*groups[j + opt.buffer_count]))
            # a short last sub-group is updated as it is (one more compiled shape), not padded
            new_master, new_moments, scalars, ok = opt._chunk.fn(
                grad(name, start, n), master, moments, self._before, self.scale)
            self._scalars, self.finite = scalars, self.finite and bool(ok)
            new = [np.asarray(x)[:n] for x in [new_master, *new_moments]]
            for part, values in zip(opt.parts, new, strict=True):
                self._writes.append(opt.store.write(f"{name}.{part}", start, values))
            while len(self._writes) > opt.buffer_count * len(opt.parts):
                self._writes.popleft().result()
            # the update has run (its outputs are on the host), so the read buffers can be
            # reused, unless an output is one of them (jit forwards an unchanged input; on
            # the CPU an input's aligned host memory is the device buffer itself)
            opt.store.recycle(*(b for b in [master, *moments]
                                if not any(np.may_share_memory(b, x) for x in new)))
            new_master = new[0]
            if sink is not None:
                sink(name, start, new_master)

    def finish(self) -> StreamStats:
        """Wait for the writes, keep the new scalars: what the step did."""
        while self._writes:
            self._writes.popleft().result()
        self.opt.scalars = [np.asarray(x) for x in self._scalars]
        store = self.opt.store
        return StreamStats(self.finite, time.perf_counter() - self._t0,
                           store.read_bytes - self._read0, store.written_bytes - self._written0)
