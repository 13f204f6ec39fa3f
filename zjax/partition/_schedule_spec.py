"""``ScheduleSpec``: how the scheduled layer scan lays out and moves a stack's leaves."""

from __future__ import annotations

import dataclasses

from zjax.partition.gather import Comm

__all__ = ["ScheduleSpec"]


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
        (:func:`~zjax.partition.gather.all_gather_bucket`), instead of one per leaf.
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
    """

    dims: tuple[int | None, ...]
    comm: Comm = dataclasses.field(default_factory=Comm)
    prefetch: int = 1
    bucket: bool = False
    offload_inputs: bool = False
    partition_inputs: str | None = None
    axes: tuple = ()
    frozen: tuple[bool, ...] = ()

    def is_frozen(self, i: int) -> bool:
        return bool(self.frozen) and self.frozen[i]

    def comms(self, comm: Comm) -> list[Comm]:
        """``comm`` per leaf, over the leaf's own axes."""
        axes = self.axes or (None,) * len(self.dims)
        return [comm if a is None or a == comm.axis_name
                else dataclasses.replace(comm, axis_name=a) for a in axes]
