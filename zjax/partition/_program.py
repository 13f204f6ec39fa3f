"""The traced loss as the gather-on-use transform sees it (:mod:`zjax.partition.transform`).

:func:`analyse` flattens a loss's jaxpr (inlining ``jit``, ``closed_call``, ``checkpoint``),
finds the views of each parameter leaf, the scans that can slice stacked leaves per iteration,
and cuts the rest into segments at the first use of each layer; :class:`Env` evaluates a
program's equations with views materialised where they are read.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore

__all__ = ["CannotRewrite", "Env", "LeafSpec", "Lit", "Op", "Program", "Segment", "analyse",
           "bind", "layer_of", "needs", "scan_split"]

# call primitives whose body is inlined: they group code and change nothing else (a user's
# checkpoint is subsumed by the per-segment one)
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat"})
# one-input ops on a parameter whose result is still "the parameter" for scheduling
_VIEWS = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims",
                    "broadcast_in_dim", "copy", "copy_p", "reduce_precision",
                    "bitcast_convert_type"})
_NUMBER = re.compile(r"(\d+)$")


class CannotRewrite(Exception):
    """The analysis met a program it does not rewrite, and says which construct.

    Raised on purpose, only where the analysis reads a form of JAX's program it does not
    know: an inlined call whose body is not a jaxpr, a ``scan`` without the parameters the
    layer schedule reads (``jaxpr``, ``length``, ``reverse``, ``num_consts``,
    ``num_carry``). The transform then gathers every parameter at the start of the loss
    (correct, memory not bounded by a layer) and warns once, naming the construct; any
    other exception is a bug and propagates.
    """


# what the layer schedule reads off a scan equation
_SCAN_PARAMS = ("jaxpr", "length", "reverse", "num_consts", "num_carry")


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One flattened parameter leaf as the transform sees it.

    Attributes:
      path: its pytree path (``a/0/b``): names the layer it belongs to.
      dim: its sharded dimension, or None (replicated: only cast).
      layered: a whole leaf (``dim`` None) that a scan over it may still slice per
        iteration, so the scan runs as a scheduled loop (stages 0-2 under ZeRO-R, whose
        saved layer inputs the loop keeps).
      axes: the mesh axes it is sharded over where they are not the ``Comm``'s (a mixture's
        expert weights), or None.
    """

    path: str
    dim: int | None
    layered: bool = False
    axes: Any = None


def layer_of(path: str) -> str:
    """The layer a leaf belongs to: its path up to the first component that ends in a number,
    that number standing for the component (``h/3/mlp/w`` -> ``h/3``; ``ln0/scale`` and
    ``up0/kernel`` -> ``0``: siblings named by layer number are one layer)."""
    parts = path.split("/")
    for n, part in enumerate(parts):
        m = _NUMBER.search(part)
        if m:
            return "/".join([*parts[:n], m.group(1)])
    return path


@dataclasses.dataclass(frozen=True)
class Lit:
    """A literal or constant operand."""

    val: Any


@dataclasses.dataclass
class Op:
    eqn: Any  # jax JaxprEqn: its primitive and params
    ins: list  # keys (hashable) or Lit
    outs: list  # keys, None for a dropped output


def flatten(jaxpr, consts, ins, ops: list, ids) -> list:
    """Append ``jaxpr``'s equations to ``ops`` with inlined calls; return its output atoms.

    Every value gets a key of its own, ``next(ids)`` (an inlined body called twice defines
    its variables twice)."""
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = Lit(c)
    for v, a in zip(jaxpr.invars, ins, strict=True):
        env[v] = a

    def atom(x):
        return Lit(x.val) if isinstance(x, jcore.Literal) else env[x]

    for eqn in jaxpr.eqns:
        args = [atom(x) for x in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _INLINE and inner is not None:
            if isinstance(inner, jcore.ClosedJaxpr):
                outs = flatten(inner.jaxpr, inner.consts, args, ops, ids)
            elif isinstance(inner, jcore.Jaxpr):
                outs = flatten(inner, [], args, ops, ids)
            else:
                raise CannotRewrite(f"a '{eqn.primitive.name}' call whose body is a "
                                    f"{type(inner).__name__}, not a jaxpr")
            for v, a in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v] = a
            continue
        keys = [None if isinstance(v, jcore.DropVar) else next(ids) for v in eqn.outvars]
        for v, k in zip(eqn.outvars, keys, strict=True):
            if k is not None:
                env[v] = k
        ops.append(Op(eqn, args, keys))
    return [atom(x) for x in jaxpr.outvars]


def bind(eqn, invals: list) -> list:
    """Run one equation on ``invals`` (as ``jax.core.eval_jaxpr`` does)."""
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


@dataclasses.dataclass
class Segment:
    kind: str  # "plain" or "scan"
    ops: list = dataclasses.field(default_factory=list)
    layers: set = dataclasses.field(default_factory=set)
    leaves: set = dataclasses.field(default_factory=set)  # sharded leaves it uses
    stacked: tuple = ()  # scan: (xs position, leaf) of the leaves the schedule slices


@dataclasses.dataclass
class Program:
    ops: list
    outs: list
    arg_keys: list
    views: dict  # key -> the op that makes it
    root: dict  # key -> leaf index (the leaf itself or a view of it)
    segments: list
    shared: list  # sharded leaves gathered once for the whole loss


def scan_split(op: Op) -> tuple[int, int]:
    return op.eqn.params["num_consts"], op.eqn.params["num_carry"]


@dataclasses.dataclass
class _Roots:
    """Which leaf each value is (the leaf itself or a view of it), and how often leaves are
    used by the program's units (ops that are not views)."""

    in_keys: list
    root: dict  # key -> leaf index
    views: dict  # key -> the op that makes it
    uses: dict = dataclasses.field(default_factory=dict)  # leaf -> units using it

    def used(self, op: Op) -> set:
        return {self.root[a] for a in op.ins if not isinstance(a, Lit) and a in self.root}


def _roots(ops: list, in_keys: list, n: int) -> tuple[_Roots, list]:
    """The roots of ``ops``' values, and the units (the ops that are not views)."""
    r = _Roots(in_keys, {in_keys[i]: i for i in range(n)}, {})
    for op in ops:  # a view of one leaf is that leaf, for scheduling
        keys = [a for a in op.ins if not isinstance(a, Lit)]
        if (op.eqn.primitive.name in _VIEWS and len(keys) == 1 and keys[0] in r.root
                and len(op.outs) == 1 and op.outs[0] is not None):
            r.root[op.outs[0]] = r.root[keys[0]]
            r.views[op.outs[0]] = op
    units = [op for op in ops if not (op.outs and op.outs[0] in r.views)]
    for op in units:
        for leaf in r.used(op):
            r.uses[leaf] = r.uses.get(leaf, 0) + 1
    return r, units


def _scheduled(op: Op, r: _Roots, leaves: Sequence[LeafSpec]) -> tuple:
    """(xs position, leaf) pairs a scan can slice per iteration; () if it cannot (a reversed
    or empty scan runs as one op, its leaves gathered whole).

    Raises:
      CannotRewrite: a scan without the parameters the schedule reads.
    """
    if op.eqn.primitive.name != "scan":
        return ()
    missing = [k for k in _SCAN_PARAMS if k not in op.eqn.params]
    if missing:
        raise CannotRewrite(f"a scan without the parameter{'s' * (len(missing) > 1)} "
                            f"{', '.join(missing)} (a form of JAX's scan zjax does not read)")
    if op.eqn.params["reverse"] or not op.eqn.params["length"]:
        return ()
    start = sum(scan_split(op))
    out = []
    for pos, a in enumerate(op.ins[start:]):
        leaf = r.root.get(a) if not isinstance(a, Lit) else None
        if leaf is None or (leaves[leaf].dim is None and not leaves[leaf].layered):
            continue
        chain_ok = a == r.in_keys[leaf] or _casts_only(a, r.views, r.in_keys[leaf])
        dup = sum(1 for b in op.ins if not isinstance(b, Lit) and r.root.get(b) == leaf)
        if leaves[leaf].dim == 0 or not chain_ok or r.uses[leaf] > 1 or dup > 1:
            return ()  # gathered whole: the leaf is not only this loop's per-layer slices
        out.append((pos, leaf))
    return tuple(out)


def _segments(units: list, r: _Roots, leaves: Sequence[LeafSpec]) -> list[Segment]:
    """Cut the units into scheduled scans and plain segments, a new plain segment at the
    first use of each layer."""
    segments: list[Segment] = []
    seen: set = set()
    current: Segment | None = None
    for op in units:
        stacked = _scheduled(op, r, leaves)
        if stacked:
            sliced = {leaf for _, leaf in stacked}
            segments.append(Segment("scan", [op], leaves={
                x for x in r.used(op) - sliced if leaves[x].dim is not None}, stacked=stacked))
            current = None
            continue
        sharded = {x for x in r.used(op) if leaves[x].dim is not None}
        new = {layer_of(leaves[x].path) for x in sharded} - seen
        if current is None or (new and current.layers):
            current = Segment("plain")
            segments.append(current)
        seen |= new
        current.layers |= new
        current.leaves |= sharded
        current.ops.append(op)
    return segments


def analyse(closed, leaves: Sequence[LeafSpec]) -> Program:
    """The loss's program: its ops flattened, cut into segments, the shared leaves apart."""
    ops: list = []
    n = len(leaves)
    ids = itertools.count()
    in_keys = [next(ids) for _ in closed.jaxpr.invars]
    outs = flatten(closed.jaxpr, closed.consts, in_keys, ops, ids)
    r, units = _roots(ops, in_keys, n)
    # a leaf the loss returns (or a view of it) is held for the whole loss, never sliced
    returned = {r.root[a] for a in outs if not isinstance(a, Lit) and a in r.root}
    for leaf in returned:
        r.uses[leaf] = r.uses.get(leaf, 0) + 1
    segments = _segments(units, r, leaves)
    count: dict = {leaf: 2 for leaf in returned if leaves[leaf].dim is not None}
    for seg in segments:
        for leaf in seg.leaves:
            count[leaf] = count.get(leaf, 0) + 1
    shared = sorted(leaf for leaf, c in count.items() if c > 1)  # used in several segments
    for seg in segments:
        seg.leaves -= set(shared)
    return Program(ops, outs, in_keys[n:], r.views, r.root, segments, shared)


def _casts_only(key, views: dict, leaf_key) -> bool:
    while key in views:
        op = views[key]
        if op.eqn.primitive.name != "convert_element_type":
            return False
        (key,) = [a for a in op.ins if not isinstance(a, Lit)]
    return key == leaf_key


class Env:
    """Values of a program's keys, with views materialised where they are read."""

    def __init__(self, prog: Program, values: dict, leaf_values: dict):
        self.prog, self.values, self.leaf_values = prog, dict(values), leaf_values

    def read(self, a):
        if isinstance(a, Lit):
            return a.val
        if a in self.values:
            return self.values[a]
        if a in self.prog.views:
            op = self.prog.views[a]
            self.values[a] = bind(op.eqn, [self.read(x) for x in op.ins])[0]
            return self.values[a]
        return self.leaf_values[self.prog.root[a]]  # a leaf (KeyError: not available here)

    def run(self, op: Op) -> None:
        for k, v in zip(op.outs, bind(op.eqn, [self.read(a) for a in op.ins]), strict=True):
            if k is not None:
                self.values[k] = v


def needs(op: Op, prog: Program) -> set:
    """Keys ``op`` reads that are neither literals nor leaves or their views."""
    return {a for a in op.ins if not isinstance(a, Lit) and a not in prog.root}
