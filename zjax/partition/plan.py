"""ShardPlan: where each parameter leaf lives, and the specs of everything derived from it.

The plan is built from an *abstract* params pytree (``jax.ShapeDtypeStruct`` leaves, nothing
allocated), the ``zero`` config section and the mesh. For each leaf it picks one dimension to
shard along the ``data`` axis (the largest one that the axis size divides, never the
stacked-layer dimension) or says why the leaf stays replicated. From that it derives the
PartitionSpecs of stored params, gradients, fp32 master params and optax state per ZeRO stage.

The model's logical axes (:mod:`zjax.partition.rules`) first split some leaves over ``model``
(tensor parallelism); ZeRO then shards each over ``data`` (x ``context``) along a *different*
dimension: gathering the shard yields exactly the device's tensor-parallel slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax.errors import ArgumentError
from zjax.partition._placement import choose_dim, nothing_to_shard, split_of
from zjax.partition._placement import persistence_threshold as _persistence
from zjax.partition.config import ZeroConfig, resolve_dtype
from zjax.partition.gather import Comm
from zjax.partition.rules import DEFAULT_RULES, Rules
from zjax.runtime import Backend, backend_of
from zjax.runtime.mesh import CONTEXT, DATA, EXPERT, MODEL, NODE, REPLICA, shard_axes, split_nodes

__all__ = ["LeafPlan", "ShardPlan", "make_plan", "path_str"]


def path_str(path) -> str:
    """``a/b/0/c`` for a jax key path."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Placement of one parameter leaf.

    Attributes:
      path: ``/``-joined key path of the leaf.
      shape: full (global) shape.
      dtype: dtype of the leaf as initialised (the master dtype).
      stacked: whether dimension 0 is a stacked-layer dimension (a ``Stack``'s leaf).
      dim: the dimension sharded over ``data``, or None if the leaf stays replicated.
      reason: why it is replicated (empty when sharded).
      model_dim: the dimension split over ``model`` (tensor parallelism), or None.
      data_axes: the mesh axes ``dim`` is split over: ``data``, ``(data, node)`` with
        ZeRO++'s hierarchical partition, ``(data, context)`` with sequence parallelism,
        ``expert`` too with expert parallelism (not for an expert leaf).
      expert_dim: the dimension split over ``expert`` (a mixture's experts), or None.
      frozen: not trained (an adapter's base weight): no gradient, no optimizer state, kept
        in its own dtype (a quantized code's integers too), sharded and gathered like the rest.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stacked: bool
    dim: int | None
    reason: str = ""
    model_dim: int | None = None
    data_axes: str | tuple[str, ...] = DATA
    expert_dim: int | None = None
    frozen: bool = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def spec(self) -> P:
        """PartitionSpec of the leaf when ZeRO-sharded: ``data`` on ``dim``, ``model`` on
        ``model_dim`` (``P()`` for a leaf whole on both axes)."""
        return self._spec(data=True)

    @property
    def model_spec(self) -> P:
        """PartitionSpec of the leaf replicated over ``data`` (still split over ``model``)."""
        return self._spec(data=False)

    def _spec(self, *, data: bool) -> P:
        axes = [None] * len(self.shape)
        if data and self.dim is not None:
            axes[self.dim] = self.data_axes
        if self.model_dim is not None:
            axes[self.model_dim] = MODEL
        if self.expert_dim is not None:
            axes[self.expert_dim] = EXPERT
        while axes and axes[-1] is None:
            axes.pop()
        return P(*axes)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Per-leaf placements plus the specs derived from them for one ZeRO stage.

    Use :func:`make_plan` to build one.
    """

    zero: ZeroConfig
    mesh: Mesh
    leaves: tuple[LeafPlan, ...]
    treedef: Any

    @property
    def n_data(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def n_model(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def n_replica(self) -> int:  # replica groups of hybrid sharding
        return self.mesh.shape.get(REPLICA, 1)

    @property
    def n_node(self) -> int:  # node groups of ZeRO++'s hierarchical partition
        return self.mesh.shape.get(NODE, 1)

    @property
    def n_shard(self) -> int:
        """Shards of a sharded leaf: ``data`` (x ``node`` under hpZ, x ``context``,
        x ``expert``); an expert leaf has :meth:`shards_of` (no ``expert``)."""
        return self.n_data * self.n_node * self.n_context * self.n_expert

    @property
    def n_expert(self) -> int:  # devices a mixture's experts are split over
        return self.mesh.shape.get(EXPERT, 1)

    def shards_of(self, leaf: LeafPlan) -> int:
        """Shards of ``leaf`` when sharded: the sizes of its ``data_axes``."""
        axes = (leaf.data_axes,) if isinstance(leaf.data_axes, str) else leaf.data_axes
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def comm_of(self, leaf: LeafPlan) -> Comm:
        """:attr:`comm` over ``leaf``'s own axes (an expert leaf's: without ``expert``)."""
        comm = self.comm
        if NODE in self.mesh.axis_names or leaf.data_axes == comm.axis_name:
            return comm
        return dataclasses.replace(comm, axis_name=leaf.data_axes)

    @property
    def n_context(self) -> int:  # devices each sequence is split over
        return self.mesh.shape.get(CONTEXT, 1)

    @property
    def n_batch(self) -> int:
        """Devices the batch's rows are split over: ``replica`` x ``node`` x ``data`` x
        ``expert``."""
        return self.n_replica * self.n_data * self.n_node * self.n_expert

    def tree(self, values) -> Any:
        return jax.tree.unflatten(self.treedef, list(values))

    @property
    def backend(self) -> Backend:
        """The quirk record of the mesh's platform (:mod:`zjax.runtime._backend`)."""
        return backend_of(self.mesh)

    @property
    def reduce_dtype(self) -> np.dtype:
        """The dtype gradients are actually reduced in on this mesh's backend.

        A backend that cannot compile 16-bit reductions (``Backend.wide_reduce``: XLA:CPU)
        reduces a 16-bit ``zero.reduce_dtype`` in float32; the plan report says so.
        """
        rd = self.zero.reduce
        if rd.itemsize < 4 and self.backend.wide_reduce:
            return np.dtype(np.float32)
        return rd

    @property
    def comm(self) -> Comm:
        """How the ZeRO collectives move this plan's leaves over ``data`` (x ``context``):
        gather and reduce dtypes, host residence, the backend's reduce-scatter."""
        axis = DATA if NODE in self.mesh.axis_names else shard_axes(self.mesh)  # hpZ: below
        return Comm(axis, self.zero.gather, self.reduce_dtype, self.params_on_host, self.scatter,
                    self.zero.quantized_weights, self.zero.quantize_block,
                    NODE if NODE in self.mesh.axis_names else None,
                    resolve_dtype(self.zero.quantize_scale_dtype,
                                  key="zero.quantize_scale_dtype"),
                    keep_casts_in_loops=self.backend.hoists_loop_casts is not None,
                    prefetch_before_vjp=self.backend.prefetch_before_vjp is not None)

    @property
    def scatter(self) -> str:
        """How gradients are reduce-scattered (:func:`zjax.partition.gather.reduce_scatter`).

        ``quantized`` with ``zero.quantized_gradients`` (ZeRO++'s qgZ); ``all_reduce`` where
        the backend's multi-process reduce-scatter is wrong
        (``Backend.scatter_via_all_reduce``: XLA:CPU through gloo) and the job has several
        processes; ``ring`` where the compiler would run a reduce-scatter as an all-reduce
        (``Backend.scatter_via_ring``: TPU); else ``direct``.
        """
        if self.zero.quantized_gradients:  # an all-to-all: no reduce-scatter to work around
            return "quantized"
        if self.backend.scatter_via_all_reduce is not None and jax.process_count() > 1:
            return "all_reduce"
        return "ring" if self.backend.scatter_via_ring is not None else "direct"

    @property
    def bucket_layer_gathers(self) -> bool:
        """Whether a prefetching layer scan moves each layer as one bucket
        (``Backend.bucket_layer_gathers``: TPU)."""
        return self.backend.bucket_layer_gathers is not None

    @property
    def join_gathers(self) -> bool:
        """Whether the gathers outside the layer loops are joined (``Backend.join_gathers``).

        See :func:`zjax.partition.gather.join_gathers`: on XLA:CPU, a collective outside a
        loop and one inside it may otherwise run at once and collide.
        """
        return self.backend.join_gathers is not None

    @property
    def leaves_by_path(self) -> dict[str, LeafPlan]:
        return {leaf.path: leaf for leaf in self.leaves}

    @property
    def dims(self) -> Any:
        """Pytree of sharded dimension (int) or None per leaf, when the stage shards it."""
        return self.tree(leaf.dim for leaf in self.leaves)

    @property
    def sharded_specs(self) -> Any:
        return self.tree(leaf.spec for leaf in self.leaves)

    @property
    def replicated_specs(self) -> Any:
        """Specs of leaves replicated over ``data`` (split over ``model`` where the rules say)."""
        return self.tree(leaf.model_spec for leaf in self.leaves)

    # ---- what is stored, per stage ----------------------------------------------------------
    @property
    def param_specs(self) -> Any:
        """Specs of the stored params: shards at stage 3, replicated below."""
        return self.sharded_specs if self.zero.stage == 3 else self.replicated_specs

    @property
    def grad_specs(self) -> Any:
        """Specs of the gradients leaving the backward pass."""
        return self.sharded_specs if self.zero.stage >= 2 else self.replicated_specs

    @property
    def state_specs(self) -> Any:
        """Specs of per-param optimizer state and fp32 master params."""
        return self.sharded_specs if self.zero.stage >= 1 else self.replicated_specs

    def stored_param_dtype(self, leaf: LeafPlan) -> np.dtype:
        """Stage 3 stores the master (no working copy); stages 0-2 a working copy. With the
        master on NVMe, stage 3 stores its sharded leaves in ``gather_dtype`` (what their
        gather casts them to anyway); persistent leaves stay float32."""
        if leaf.frozen or not np.issubdtype(leaf.dtype, np.floating):
            return leaf.dtype
        if self.zero.stage == 3 and not (self.opt_on_nvme and leaf.dim is not None):
            return leaf.dtype
        return self.zero.gather

    @property
    def opt_on_nvme(self) -> bool:
        """Whether the float32 master and the optimizer state live in NVMe swap files."""
        return self.zero.offload_optimizer.nvme

    @property
    def has_master(self) -> bool:
        """Whether a float32 master is stored apart on the device or in host memory (stages
        0-2, narrower working dtype; never with the master on NVMe)."""
        return not self.opt_on_nvme and self.zero.stage < 3 and any(
            self.stored_param_dtype(leaf) != leaf.dtype for leaf in self.leaves
        )

    # ---- host offload ---------------------------------------------------------------------------
    @property
    def opt_on_host(self) -> bool:
        """Whether the optimizer state lives in host memory between steps."""
        return self.zero.offload_optimizer.enabled

    @property
    def master_on_host(self) -> bool:
        """Whether the float32 master (stage 3: the stored params) lives in host memory."""
        return self.zero.offload_param.enabled

    @property
    def params_on_host(self) -> bool:
        """Whether the stored params, which the forward gathers, live in host memory."""
        return self.master_on_host and self.zero.stage == 3

    def opt_specs(self, tx: optax.GradientTransformation, opt_state: Any) -> Any:
        """Specs of an optax state: per-param leaves as :attr:`state_specs`, others replicated
        (a leaf another transform of ``optax.multi_transform`` holds stays masked)."""
        masked = optax.MaskedNode
        return optax.tree_map_params(
            tx, lambda value, spec: value if isinstance(value, masked) else spec, opt_state,
            self.state_specs, transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, (P, masked)))

    def shardings(self, specs: Any) -> Any:
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    # ---- reporting --------------------------------------------------------------------------
    @property
    def replicated(self) -> list[LeafPlan]:
        return [leaf for leaf in self.leaves if leaf.dim is None]

    def leaf_bytes(self, leaf: LeafPlan, dtype, sharded: bool) -> int:
        """Bytes of ``leaf`` in ``dtype`` on one device: split over ``model`` where the rules
        say, and over ``data`` too when ``sharded`` (the stage shards it) and the plan does."""
        n = self.shards_of(leaf) if sharded and leaf.dim is not None else 1
        n *= self.n_model if leaf.model_dim is not None else 1
        n *= self.n_expert if leaf.expert_dim is not None else 1
        return leaf.size // n * np.dtype(dtype).itemsize


def make_plan(
    abstract_params: Any,
    zero: ZeroConfig,
    mesh: Mesh,
    *,
    stacked: Callable[[str], bool] | None = None,
    logical_axes: Callable[[str], tuple[str | None, ...] | None] | None = None,
    rules: Rules = DEFAULT_RULES,
    frozen: Callable[[str], bool] | None = None,
) -> ShardPlan:
    """Decide the placement of every parameter leaf.

    Args:
      abstract_params: params pytree of ``jax.ShapeDtypeStruct`` (or arrays).
      zero: the ``zero`` config section.
      mesh: a mesh with ``data`` and ``model`` axes. With ``zero.hpz_partition_size`` k
        the plan's mesh splits ``data`` into ``(node, data)``: groups of k devices.
      stacked: predicate on a leaf's path: True for leaves whose dimension 0 stacks layers.
      logical_axes: a leaf's logical dimension names by path (a stacked leaf's may omit the
        layer dimension), or None; :data:`~zjax.partition.rules.DEFAULT_RULES` maps them to
        ``model``.
      rules: ``(logical name, mesh axis)`` pairs.
      frozen: predicate on a leaf's path: True for leaves that are not trained (their
        integer leaves, a quantized weight's codes, are sharded like float ones); then the
        trained ones (adapters) are sharded below ``param_persistence_threshold`` too.

    Returns:
      The :class:`ShardPlan`.

    Raises:
      ConfigError: stage 3 was asked for but no leaf can be sharded; ``mesh.model`` does not
        divide a dimension it must split, or the model has nothing to split over it.
    """
    if zero.hpz_partition_size > 1 and NODE not in mesh.axis_names:
        mesh = split_nodes(mesh, zero.hpz_partition_size)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    adapted = bool(frozen) and any(frozen(path_str(p)) for p, _ in flat)
    leaves = []
    for key_path, leaf in flat:
        path = path_str(key_path)
        is_stacked = bool(stacked and stacked(path))
        is_frozen, shape = bool(frozen and frozen(path)), tuple(leaf.shape)
        split = split_of(path, shape, is_stacked, logical_axes, rules, mesh)
        if zero.stage == 0:
            dim, reason = None, "stage 0 replicates everything"
        elif not (is_frozen or np.issubdtype(leaf.dtype, np.floating)):
            dim, reason = None, f"not a float leaf ({leaf.dtype})"
        else:
            dim, reason = choose_dim(
                shape, n=split.n, stacked=is_stacked,
                threshold=_persistence(zero, adapter=adapted and not is_frozen),
                taken=(split.model_dim, split.expert_dim), over=split.over)
        leaves.append(LeafPlan(path, shape, np.dtype(leaf.dtype), is_stacked, dim, reason,
                               split.model_dim, split.data_axes, split.expert_dim, is_frozen))
    for axis, field in ((MODEL, "model_dim"), (EXPERT, "expert_dim")):
        _check_named(axis, field, mesh, leaves, rules)
    plan = ShardPlan(zero, mesh, tuple(leaves), treedef)
    if zero.stage == 3 and plan.n_shard > 1 and len(plan.replicated) == len(leaves):
        raise nothing_to_shard(leaves, zero.param_persistence_threshold)
    return plan


def _check_named(axis: str, field: str, mesh: Mesh, leaves: list[LeafPlan], rules: Rules):
    """A mesh axis above 1 that no leaf's named dimension is split over is refused."""
    size = mesh.shape.get(axis, 1)
    if size > 1 and all(getattr(leaf, field) is None for leaf in leaves):
        raise ArgumentError(
            "mesh" if axis == MODEL else f"mesh.{axis}",
            f"{'an' if axis[0] in 'aeiou' else 'a'} {axis} axis of {size}, but the model "
            f"names no parameter dimension that the rules split over it "
            f"({', '.join(k for k, v in rules if v == axis)}); annotate its weights with "
            f"logical axes (see zjax.partition.rules) or set mesh.{axis}: 1")
