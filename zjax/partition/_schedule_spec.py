"""``ScheduleSpec``: how the scheduled layer scan lays out and moves a stack's leaves."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax import lax

from zjax.partition.gather import Comm

__all__ = ["BUCKET_CAP_BYTES", "ScheduleSpec", "bucket_bytes", "bucket_groups", "over_cap"]

# A layer's bucket is gathered whole, split into its leaves (a copy of it) and, in the
# backward, its gradients are joined (another): a few layers' worth of temp. Past this many
# gathered bytes a layer moves in runs of leaves up to this size (bucket_groups). A
# trillion-parameter layer (d_model 20480, d_ff 81920: 11.1 GiB gathered in bfloat16),
# v5p:2x2x2, 2 layers: temp 88.59 -> 57.24 GiB leaf by leaf, gathers overlapped 63% -> 45%;
# the layers measured with the bucket (up to Llama 3 70B's, 1.6 GiB) keep it.
BUCKET_CAP_BYTES = 4 << 30


def bucket_bytes(shards, comm: Comm) -> int:
    """The gathered bytes of a layer whose sharded leaves' local slices are ``shards``
    (inside ``shard_map``)."""
    axes = comm.axis_name if isinstance(comm.axis_name, tuple) else (comm.axis_name,)
    if comm.node_axis is not None:
        axes = (*axes, comm.node_axis)
    n = math.prod(lax.axis_size(a) for a in axes)
    itemsize = np.dtype(comm.gather_dtype or np.float32).itemsize
    return sum(math.prod(x.shape[1:]) for x in shards) * n * itemsize


def bucket_groups(candidates: list[int], stacked: list, comm: Comm) -> list[list[int]]:
    """The layer buckets of the leaves ``candidates`` (indices into ``stacked``, a layer
    stack's sharded leaves inside ``shard_map``): all of them as one bucket where they gather
    to at most :data:`BUCKET_CAP_BYTES`, else runs of consecutive leaves up to it each (a
    leaf alone moves by itself). Only groups of two or more are returned."""
    cap = BUCKET_CAP_BYTES
    sizes = [bucket_bytes([stacked[i]], comm) for i in candidates]
    if sum(sizes) <= cap:
        groups = [list(candidates)]
    else:
        groups, total = [[]], 0
        for i, size in zip(candidates, sizes, strict=True):
            if groups[-1] and total + size > cap:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += size
    return [g for g in groups if len(g) > 1]


def over_cap(buckets: list[list[int]], candidates: list[int]) -> bool:
    """Whether a layer meant to move as one bucket (``candidates``) was split by
    :func:`bucket_groups` (it gathers to more than :data:`BUCKET_CAP_BYTES`)."""
    return bool(candidates) and buckets != [list(candidates)]


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """Static description of how a stack's leaves are laid out and moved.

    Attributes:
      dims: per flattened leaf, the sharded dimension of the *stacked* leaf (>= 1), or None.
      comm: the axis, dtypes (None: float32), host residence and reduce-scatter method. With
        ``from_host`` each layer's slice is brought to the device as it is gathered, and each
        layer's gradient shard goes back into a host buffer as soon as it is reduce-scattered.
      prefetch: how many layers ahead to gather.
      bucket: with prefetch, move a layer's sharded float leaves as one bucket: one
        all-gather per layer and one reduce-scatter per layer gradient
        (:func:`~zjax.partition.gather.all_gather_bucket`), instead of one per leaf; not
        for a layer over :data:`BUCKET_CAP_BYTES` gathered.
      offload_inputs: keep the layer inputs saved for the backward in host memory
        (``pinned_host``), each sent there as the forward leaves its layer and brought back
        as the backward reaches it (DeepSpeed's ``cpu_checkpointing``).
      partition_inputs: a mesh axis the layer inputs are replicated over (tensor
        parallelism's ``model``): each device keeps its ``1/n`` of their last dimension and
        the backward all-gathers it (DeepSpeed's ``partition_activations``).
      axes: per flattened leaf, the mesh axes it is sharded over where they are not
        ``comm.axis_name``'s (a mixture's expert weights: the data devices holding the same
        experts), else None; empty: every leaf over ``comm.axis_name``.
      frozen: per flattened leaf, whether it is frozen (not trained: no weight gradient is
        computed or reduce-scattered for it, its cotangent is zero); empty: none is.
      fp8: per flattened leaf, whether it is gathered in FP8 (``zero.fp8_gather``: a weight
        an FP8 matmul reads); empty: none is.
    """

    dims: tuple[int | None, ...]
    comm: Comm = dataclasses.field(default_factory=Comm)
    prefetch: int = 1
    bucket: bool = False
    offload_inputs: bool = False
    partition_inputs: str | None = None
    axes: tuple = ()
    frozen: tuple[bool, ...] = ()
    fp8: tuple[bool, ...] = ()

    def is_frozen(self, i: int) -> bool:
        return bool(self.frozen) and self.frozen[i]

    def comms(self, comm: Comm) -> list[Comm]:
        """``comm`` per leaf, over the leaf's own axes."""
        axes = self.axes or (None,) * len(self.dims)
        fp8 = self.fp8 or (False,) * len(self.dims)
        out = [comm if a is None or a == comm.axis_name
               else dataclasses.replace(comm, axis_name=a) for a in axes]
        return [dataclasses.replace(c, fp8=True) if f else c
                for c, f in zip(out, fp8, strict=True)]
