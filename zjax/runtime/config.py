"""The ``mesh`` section (read by ``zjax.config`` without loading JAX)."""

from __future__ import annotations

import dataclasses

from zjax.errors import ConfigError
from zjax.schema import choices, positive, validate

__all__ = ["MeshConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The ``mesh`` section: axis sizes; one may be -1 to take all remaining devices.

    Attributes:
      data: size of the ``data`` axis (ZeRO shards along it).
      model: size of the ``model`` axis (tensor parallelism: the model's heads and MLP
        hidden units are split over it; ZeRO shards over ``data``).
      replica: size of the ``replica`` axis, hybrid sharding (PyTorch FSDP2's HSDP,
        DeepSpeed's MiCS): ZeRO shards over the ``data`` devices of each replica group and
        every group holds the same shards; the batch is split over replica x data, gradients
        are reduce-scattered over ``data`` then all-reduced over ``replica`` (shards only).
        Put ``data`` within a node and ``replica`` across nodes.
      context: size of the ``context`` axis, sequence (context) parallelism: each sequence's
        tokens are split over it (DeepSpeed's ``sequence_parallel_size``), attention runs as
        Ulysses or ring attention across it (``model.context_attention``), and ZeRO shards
        over ``data`` x ``context``, as DeepSpeed-Ulysses does. The batch's rows are split over
        ``data`` only. Put ``context`` within a node.
      expert: size of the ``expert`` axis, expert parallelism (DeepSpeed-MoE's ``ep_size``):
        a mixture's experts are split over it and tokens reach theirs by all-to-all; the
        batch's rows are split over ``data`` x ``expert``; ZeRO shards every other leaf over
        ``data`` x ``expert`` and the experts' weights over the ``data`` devices that hold the
        same experts (DeepSpeed's expert-data-parallel group). It must divide the experts.
      distributed: join a multi-process job through ``jax.distributed``: ``auto`` when the
        environment says this process is one of several (``zjax launch``, ``ZJAX_*``
        variables, SLURM, Open MPI), ``on`` to require it, ``off`` to run alone.
      init_timeout_s: how long a process waits for the coordinator before a clear error.
    """

    data: int = positive(-1, also=(-1,))
    model: int = positive(1, also=(-1,))
    replica: int = positive(1)
    context: int = positive(1)
    expert: int = positive(1)
    distributed: str = choices("auto", "on", "off", default="auto")
    init_timeout_s: int = positive(300)

    def __post_init__(self):
        validate(self, "mesh")
        if self.data == -1 and self.model == -1:
            raise ConfigError("mesh.data and mesh.model are both -1; at most one may be -1")
