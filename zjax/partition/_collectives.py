"""Collectives that move ZeRO shards: all-gathers that keep their dtype, reduce-scatter
methods, layer buckets, and the :class:`Comm` record that says how a plan moves its shards.

With ZeRO++'s hierarchical partition (hpZ, ``Comm.node_axis``) a leaf is sharded over
``(data, node)``: shard ``d * nodes + h`` sits on device ``d`` of node ``h``. Gathering over
``node`` first gives each device a contiguous ``1 / k`` slice of the weight (its secondary
partition); gathering that over ``data`` (within the node) gives the whole weight, and the
backward can re-gather from the slice without leaving the node. Reduce-scatters run the other
way: within the node (to the slice), then across nodes (to the shard).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zjax.partition._quantized import (
    dequantize_rows,
    gather_rows,
    quantize_shard,
    quantized_all_gather,
    quantized_reduce_scatter,
)
from zjax.partition._rows import from_rows, to_rows
from zjax.partition.fp8 import E4M3, Scaled, quantize

__all__ = [
    "RING_LONGEST",
    "RING_SCOPE",
    "SCATTER_METHODS",
    "UINT",
    "Comm",
    "all_gather",
    "all_gather_bucket",
    "gather_fp8",
    "gather_levels",
    "gather_within",
    "quantized_all_gather",
    "reduce_scatter",
    "reduce_scatter_bucket",
    "ring_factors",
    "scatter_levels",
]

UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def all_gather(x: jax.Array, axis_name: str, *, axis: int, name: str | None = None) -> jax.Array:
    """Tiled all-gather that moves exactly ``x.dtype``'s bytes.

    XLA's algebraic simplifier moves a float convert that follows an all-gather in front of
    it (so a bf16 gather feeding f32 math would move f32). Gathering the bits as unsigned
    integers of the same width pins the communicated dtype. ``name`` tags the gathered bits
    with ``checkpoint_name`` (the bitcasts around them are views the remat policy recomputes).
    """
    tag = (lambda v: checkpoint_name(v, name)) if name else (lambda v: v)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return tag(lax.all_gather(x, axis_name, axis=axis, tiled=True))
    bits = lax.bitcast_convert_type(x, UINT[x.dtype.itemsize])
    full = tag(lax.all_gather(bits, axis_name, axis=axis, tiled=True))
    return lax.bitcast_convert_type(full, x.dtype)


SCATTER_METHODS = ("direct", "all_reduce", "ring", "quantized")
# the name scope of a ring's collective-permutes: zjax.planning reads them as one reduce-scatter
RING_SCOPE = "zjax_ring_reduce_scatter"
# the longest ring a reduce-scatter runs: more devices are split into rings within rings
RING_LONGEST = 16


def reduce_scatter(x: jax.Array, axis_name: str, *, dim: int, method: str = "direct",
                   block: int = 256, scale_dtype=np.float32,
                   ring_longest: int = RING_LONGEST) -> jax.Array:
    """Tiled reduce-scatter of ``x`` along ``dim`` over ``axis_name``.

    ``method`` (:data:`SCATTER_METHODS`):

    - ``direct``: ``lax.psum_scatter``, the compiler's reduce-scatter.
    - ``all_reduce``: an all-reduce, keeping this device's slice: twice the traffic, but
      correct where XLA:CPU's reduce-scatter is not. With ``jax.distributed`` initialised,
      XLA:CPU runs collectives through gloo, whose halving-doubling reduce-scatter
      intermittently returns wrong values at the end of rank 0's chunk, with no error
      (jax-ml/jax#40830; seen here as a silently wrong embedding row on 2 processes).
    - ``ring``: ``n - 1`` collective-permutes of one tile each around the ring of
      ``axis_name``, adding this device's tile of the passing sum at every hop: the bytes of
      a reduce-scatter, on a compiler that would run ``direct`` as an all-reduce (libtpu).
      Over more than ``ring_longest`` devices, rings within rings
      (:func:`ring_factors`): the same bytes in fewer hops.
      Sums in a different order than ``direct`` (rounding differs, not the result).
    - ``quantized``: ZeRO++'s qgZ: every device's tile for device j is quantized to blockwise
      int8 (``block`` elements per ``scale_dtype`` scale), an all-to-all delivers each device the
      tiles meant for it, and it sums them dequantized in float32: about a quarter of a
      float32 reduce-scatter's bytes, at int8's rounding of each device's contribution.
    """
    if method == "direct":
        return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
    if method == "quantized":
        return quantized_reduce_scatter(x, axis_name, dim=dim, block=block,
                                        scale_dtype=scale_dtype)
    n = lax.axis_size(axis_name)
    if method == "all_reduce":
        size = x.shape[dim] // n
        return lax.dynamic_slice_in_dim(lax.psum(x, axis_name), lax.axis_index(axis_name) * size,
                                        size, axis=dim)
    if method != "ring":
        raise ValueError(f"reduce_scatter method {method!r}; choose from {SCATTER_METHODS}")

    return _ring_reduce_scatter(x, axis_name, dim=dim,
                                factors=ring_factors(n, longest=ring_longest))


def ring_factors(n: int, *, longest: int = RING_LONGEST) -> list[int]:
    """The ring lengths of a ring reduce-scatter over ``n`` devices: ``n`` itself up to
    ``longest``, else factors of ``n`` of at most ``longest`` each where ``n`` has them
    (a prime over it stays whole), largest first."""
    if n <= longest:
        return [n]
    primes, m, p = [], n, 2
    while p * p <= m:
        while m % p == 0:
            primes.append(p)
            m //= p
        p += 1
    primes += [m] if m > 1 else []
    factors: list[int] = []
    for q in sorted(primes, reverse=True):  # each prime into the smallest ring it fits
        fit = [i for i, f in enumerate(factors) if f * q <= longest]
        if fit:
            i = min(fit, key=lambda i: factors[i])
            factors[i] *= q
        else:
            factors.append(q)
    return sorted(factors, reverse=True)


def _ring_reduce_scatter(x: jax.Array, axis_name, *, dim: int, factors: list[int]) -> jax.Array:
    """Rings within rings: device ``me = i_0 (f_1 f_2 ...) + i_1 (f_2 ...) + ...`` first sums,
    around the ring of the devices differing only in ``i_0``, its ``1 / f_0`` chunk ``i_0``,
    then within that chunk over ``i_1``, and so on: ``(n - 1) / n`` of the tensor moved, as
    one ring of ``n`` moves, in ``sum(f - 1)`` hops instead of ``n - 1`` (at 1,024 devices
    29 for 1,023: the compiler's time grows with the hops)."""
    n, stride = math.prod(factors), math.prod(factors)
    me = lax.axis_index(axis_name)
    # the scope names the ring's size and hops: zjax.planning reads each hop's share of it
    with jax.named_scope(f"{RING_SCOPE}_n{n}_h{sum(f - 1 for f in factors)}"):
        for f in factors:
            stride //= f
            i, size = (me // stride) % f, x.shape[dim] // f
            ring = [(j, j + stride if (j // stride) % f < f - 1 else j - (f - 1) * stride)
                    for j in range(n)]

            def tile(t, x=x, f=f, size=size):
                return lax.dynamic_slice_in_dim(x, (t % f) * size, size, axis=dim)

            # after hop s the passing sum covers ring positions i - s .. i of chunk
            # i - s - 1: after f - 1 hops every device holds the whole sum of its own chunk
            acc = tile(i + f - 1)
            for s in range(1, f):
                acc = lax.ppermute(acc, axis_name, ring) + tile(i + f - 1 - s)
            x = acc
    return x


def all_gather_bucket(shards: list[jax.Array], dims: list[int], axis_name: str) -> list[jax.Array]:
    """Tiled all-gathers of several shards (each along its ``dims`` entry) as one collective.

    The shards' bits (one dtype width) are flattened into one buffer, gathered once as
    ``(n, total)`` rows (one per device) and split into the gathered leaves. One collective
    per bucket, as DeepSpeed's parameter buckets and FSDP's flat parameters: a compiler that
    runs one asynchronous collective at a time (TPU) can hide the whole bucket behind one
    stretch of compute instead of fitting several gathers between ops.
    """
    width = {x.dtype.itemsize for x in shards}
    if len(width) != 1:
        raise ValueError(f"a bucket holds one dtype width, got {sorted(width)} bytes")
    uint = UINT[width.pop()]
    flat = [lax.bitcast_convert_type(x, uint).reshape(-1) for x in shards]
    rows = lax.all_gather(jnp.concatenate(flat), axis_name, axis=0, tiled=False)
    sizes = np.cumsum([f.size for f in flat])[:-1]
    return [lax.bitcast_convert_type(from_rows(r, x.shape, d), x.dtype)
            for r, x, d in zip(jnp.split(rows, sizes, axis=1), shards, dims, strict=True)]


def reduce_scatter_bucket(values: list[jax.Array], dims: list[int], axis_name: str, *,
                          method: str = "direct", block: int = 256,
                          scale_dtype=np.float32) -> list[jax.Array]:
    """Tiled reduce-scatters of several values (one dtype) as one collective.

    The inverse layout of :func:`all_gather_bucket`: each value's tiles become rows of one
    ``(n, total)`` buffer whose reduce-scatter gives every device its row.
    """
    n = lax.axis_size(axis_name)
    rows = [to_rows(v, d, n) for v, d in zip(values, dims, strict=True)]
    sizes = np.cumsum([r.shape[1] for r in rows])[:-1]
    mine = reduce_scatter(jnp.concatenate(rows, axis=1), axis_name, dim=0, method=method,
                          block=block, scale_dtype=scale_dtype)[0]
    return [part.reshape(*v.shape[:d], v.shape[d] // n, *v.shape[d + 1:])
            for part, v, d in zip(jnp.split(mine, sizes), values, dims, strict=True)]


@dataclasses.dataclass(frozen=True)
class Comm:
    """How ZeRO moves parameters: one record for every gather and reduce-scatter.

    Attributes:
      axis_name: the mesh axis the shards are spread over (with ``node_axis``: the devices
        of one node, the secondary partition's group).
      node_axis: ZeRO++'s hpZ: the shards are spread over ``(axis_name, node_axis)``
        (:attr:`axes`); gathers run across nodes first, then within the node
        (:func:`gather_levels`), and reduce-scatters the other way (:func:`scatter_levels`).
      gather_dtype: dtype floating weights are gathered and computed in (None: the shard's).
      reduce_dtype: dtype their gradients are reduce-scattered in (None: the shard's).
      from_host: the shards live in host memory (``zero.offload_param``): each is brought to
        the device as it is gathered, and its gradient goes back to host memory.
      scatter: how gradients are reduce-scattered (:func:`reduce_scatter`'s ``method``).
      quantize: gather floating shards as blockwise int8 (:func:`quantized_all_gather`,
        ZeRO++'s qwZ) instead of in ``gather_dtype``.
      block: elements per quantization block (quantized gathers, and the ``quantized``
        reduce-scatter).
      scale_dtype: dtype of the quantization blocks' scales (float32 or bfloat16).
      keep_casts_in_loops: :meth:`cast` rounds with ``reduce_precision`` before it converts
        (``Backend.hoists_loop_casts``: libtpu hoists a plain convert of a layer's slice out
        of the layer loop and converts the whole stack up front).
      prefetch_before_vjp: the scheduled scan's backward waits for its prefetched weights
        before it starts the layer's VJP (``Backend.prefetch_before_vjp``).
      fp8: gather floating shards as ``float8_e4m3fn`` scaled by the whole weight's absolute
        maximum (``zero.fp8_gather``; :func:`gather_fp8`), handed to the FP8 matmuls as
        those bytes and their scale (never brought back to ``gather_dtype``).
    """

    axis_name: str = "data"
    gather_dtype: Any = None
    reduce_dtype: Any = None
    from_host: bool = False
    scatter: str = "direct"
    quantize: bool = False
    block: int = 256
    node_axis: str | None = None
    scale_dtype: Any = np.float32
    keep_casts_in_loops: bool = False
    prefetch_before_vjp: bool = False
    fp8: bool = False

    def cast(self, w: jax.Array) -> jax.Array:
        """A floating ``w`` in ``gather_dtype``.

        With :attr:`keep_casts_in_loops`, rounded to that dtype's mantissa first: the values
        the convert gives anyway, through an op the compiler does not move out of the loop
        that slices ``w``, so the convert stays there too. Only where the target has the
        exponent range of ``w`` (float32 -> bfloat16): ``reduce_precision`` flushes what
        would be float16 denormals to zero.
        """
        dtype = np.dtype(self.gather_dtype or w.dtype)
        info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else None
        if (self.keep_casts_in_loops and info is not None and dtype != w.dtype
                and info.nexp >= jnp.finfo(w.dtype).nexp):
            w = lax.reduce_precision(w, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        return w.astype(dtype)

    @property
    def axes(self) -> str | tuple[str, str]:
        """The mesh axes the shards are spread over: a sharded dimension's PartitionSpec
        entry, and the axes a replicated leaf's gradient is summed over."""
        return self.axis_name if self.node_axis is None else (self.axis_name, self.node_axis)

    def resolved(self, dtype) -> Comm:
        """This record with the dtypes left None set to ``dtype``."""
        return dataclasses.replace(self, gather_dtype=np.dtype(self.gather_dtype or dtype),
                                   reduce_dtype=np.dtype(self.reduce_dtype or dtype))


def _bits(x: jax.Array) -> jax.Array:
    """A float array as unsigned integers of its width (the dtype a gather moves)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return lax.bitcast_convert_type(x, UINT[x.dtype.itemsize])


def gather_levels(x: jax.Array, comm: Comm, *, axis: int, name: str | None = None
                  ) -> tuple[jax.Array, Any]:
    """All-gather shard ``x`` (already in the gather dtype unless ``comm.quantize``) along
    ``axis``: ``(the whole weight in comm.gather_dtype, its secondary partition)``.

    The secondary partition is None without ``comm.node_axis``; with it, it is what this
    device holds after the gather across nodes (a ``1 / k`` slice, or its int8 rows and
    scales with ``comm.quantize``), from which :func:`gather_within` rebuilds the weight.
    ``name`` tags the whole weight (and the within-node gather) for the remat policy. The
    scheduled layer scan keeps the secondary partition for its backward itself; the gather
    primitive's remat sees one call and runs both levels again.
    """
    tag = (lambda v: checkpoint_name(v, name)) if name else (lambda v: v)
    if comm.quantize:
        parts = quantize_shard(x, comm.block, comm.scale_dtype)
        secondary = None
        if comm.node_axis is not None:
            parts = secondary = gather_rows(parts, comm.node_axis)
        parts = gather_rows(parts, comm.axis_name, tag)
        return dequantize_rows(parts, x.shape, axis, comm.gather_dtype, tag,
                               comm.scale_dtype), secondary
    if comm.node_axis is None:
        return all_gather(x, comm.axis_name, axis=axis, name=name), None
    # kept as the gathered bits: a float view of them stacked for the backward measured as
    # a second copy of the stack (XLA:CPU, d_model 512: +12.6 MB of temp instead of +6.3)
    bits = _bits(x)
    secondary = lax.all_gather(bits, comm.node_axis, axis=axis, tiled=True)
    full = tag(lax.all_gather(secondary, comm.axis_name, axis=axis, tiled=True))
    return lax.bitcast_convert_type(full, x.dtype), secondary


def gather_fp8(x: jax.Array, comm: Comm, *, axis: int, name: str | None = None) -> Scaled:
    """Float shard ``x`` gathered along ``axis`` as ``float8_e4m3fn`` bytes scaled by the
    whole weight's absolute maximum (the maximum over every bound mesh axis): the
    :class:`~zjax.partition.fp8.Scaled` an FP8 matmul reads without a round trip through
    the gather dtype (``zero.fp8_gather``)."""
    q = quantize(x, E4M3)  # the bits move as bytes: no convert can slip in front of them
    return Scaled(all_gather(q.data, comm.axis_name, axis=axis, name=name), q.scale)


def gather_within(secondary: Any, comm: Comm, *, axis: int, shard_shape: tuple[int, ...],
                  dtype, name: str | None = None) -> jax.Array:
    """The whole weight (in ``dtype``) from its secondary partition (:func:`gather_levels`),
    gathered over ``comm.axis_name`` only: hpZ's backward gather, which stays inside the node.
    ``shard_shape``: the shape of the primary shard (the quantized rows' layout)."""
    tag = (lambda v: checkpoint_name(v, name)) if name else (lambda v: v)
    if not comm.quantize:
        full = tag(lax.all_gather(secondary, comm.axis_name, axis=axis, tiled=True))
        return lax.bitcast_convert_type(full, dtype) if full.dtype != dtype else full
    parts = gather_rows(secondary, comm.axis_name, tag)
    return dequantize_rows(parts, shard_shape, axis, dtype, tag, comm.scale_dtype)


def scatter_levels(x: jax.Array, comm: Comm, *, dim: int) -> jax.Array:
    """Reduce-scatter ``x`` (in the reduce dtype) to this device's shard along ``dim``, with
    ``comm.scatter``'s method: within the node, then across nodes with ``comm.node_axis``
    (each level moves its own share; only the second leaves the node)."""
    kw = dict(method=comm.scatter, block=comm.block, scale_dtype=comm.scale_dtype)
    x = reduce_scatter(x, comm.axis_name, dim=dim, **kw)
    if comm.node_axis is not None:
        x = reduce_scatter(x, comm.node_axis, dim=dim, **kw)
    return x
