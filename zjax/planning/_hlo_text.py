"""Reading a compiled, scheduled HLO module's text: computations, instructions, loop trips.

The text of a scheduled module lists each computation's instructions in execution order, which
is what the overlap figure relies on. The three backends spell some things differently; this
module reads all three:

- loop trip counts: XLA:CPU and GPU write ``known_trip_count`` in the while's backend config;
  TPU does not, so the count is read off the loop's condition (``i < N``), the induction
  variable's initial value in the while's operand tuple, and its step in the body.
- async collectives: GPU writes ``all-gather-start``/``-done`` pairs (the start's shape holds
  operands and results); TPU fuses an async collective into an ``async-collective-start``
  fusion, ``async_collective_fusion`` continuations (compute with collective steps inside) and
  an ``async-collective-done`` fusion, each of which holds a copy of the collective.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

__all__ = ["KINDS", "Instr", "Module", "axes_of", "group_size", "parse_module", "replica_groups",
           "shape_bytes", "tuple_elements"]

KINDS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
         "all-reduce": "all_reduce", "all-to-all": "all_to_all",
         "ragged-all-to-all": "all_to_all", "collective-permute": "collective_permute"}

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLEES = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: ``name = shape opcode(operands), attributes``."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    line: str
    root: bool = False

    @property
    def callees(self) -> list[str]:
        names = _CALLEES.findall(self.line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", self.line)
        if branches:
            names += [c.strip().lstrip("%") for c in branches.group(1).split(",")]
        return names

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.line)
        return m.group(1) if m else None


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed module: computations (name -> instructions in schedule order), the entry."""

    comps: dict[str, list[Instr]]
    entry: str

    def weights(self, *, skip=lambda instr: False) -> dict[str, float]:
        """How often each computation runs per execution of the entry.

        A loop's body and condition count its trip count times; ``skip(instr)`` leaves out the
        computations an instruction calls (e.g. the copies of a TPU async collective).
        """
        weight: dict[str, float] = defaultdict(float)
        defs = {name: {i.name: i for i in instrs} for name, instrs in self.comps.items()}

        def visit(name: str, w: float, depth: int) -> None:
            if name not in self.comps or depth > 64:
                return
            weight[name] += w
            for instr in self.comps[name]:
                if skip(instr):
                    continue
                if instr.opcode == "while":
                    trips = trip_count(instr, defs[name], self.comps)
                    body, cond = instr.attr("body"), instr.attr("condition")
                    if body:
                        visit(body, w * trips, depth + 1)
                    if cond:
                        visit(cond, w * (trips + 1), depth + 1)
                    continue
                for callee in instr.callees:
                    visit(callee, w, depth + 1)

        visit(self.entry, 1.0, 0)
        return dict(weight)


def _operand_names(line: str, start: int) -> tuple[str, ...]:
    depth, end = 0, len(line)
    for i in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            end = i
            break
    return tuple(re.findall(r"%([\w.\-]+)", line[start:end]))


def parse_module(hlo_text: str) -> Module:
    """Parse ``compiled.as_text()`` into computations of :class:`Instr`."""
    comps: dict[str, list[Instr]] = {}
    entry = current = None
    for raw in hlo_text.splitlines():
        m = _COMP.match(raw.strip())
        if m and not raw.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if raw.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        line = _COMMENT.sub("", raw)
        op = _INSTR.match(line)
        if op:
            comps[current].append(Instr(op.group(2), op.group(3), op.group(4),
                                        _operand_names(line, op.end() - 1), line,
                                        bool(op.group(1))))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a (possibly tuple) shape."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        if dtype in _DTYPE_BYTES:
            n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            total += n * _DTYPE_BYTES[dtype]
    return total


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (``[shape]`` for an array shape)."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                out.append(shape[start:i])
        elif ch == "," and depth == 1:
            out.append(shape[start:i])
            start = i + 1
    return [s.strip() for s in out if s.strip()]


def _constant(name: str, defs: dict[str, Instr]) -> int | None:
    """The integer a scalar value is, following copies and converts to a constant."""
    for _ in range(16):
        instr = defs.get(name)
        if instr is None:
            return None
        if instr.opcode == "constant":
            m = re.search(r"constant\((-?\d+)\)", instr.line)
            return int(m.group(1)) if m else None
        if instr.opcode not in ("copy", "convert", "bitcast") or not instr.operands:
            return None
        name = instr.operands[0]
    return None


def _tuple_index(name: str, defs: dict[str, Instr]) -> int | None:
    """``k`` when ``name`` is (a copy of) ``get-tuple-element(param), index=k``."""
    instr = defs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast") and instr.operands:
        instr = defs.get(instr.operands[0])
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    m = re.search(r"index=(\d+)", instr.line)
    return int(m.group(1)) if m else None


def trip_count(loop: Instr, defs: dict[str, Instr], comps: dict[str, list[Instr]]) -> int:
    """Iterations of a ``while``: its ``known_trip_count``, else read off its condition.

    The condition ``compare(gte(param, k), constant(N)), direction=LT`` with the loop tuple's
    element ``k`` starting at a constant and stepping by a constant in the body. Unreadable
    loops count once.
    """
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.line)
    if known:
        return int(known.group(1))
    cond = comps.get(loop.attr("condition") or "", [])
    cdefs = {i.name: i for i in cond}
    root = next((i for i in cond if i.root), None)
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return 1
    direction = re.search(r"direction=(\w+)", root.line)
    a, b = root.operands
    k, bound = _tuple_index(a, cdefs), _constant(b, cdefs)
    if k is None or bound is None:
        return 1
    init_tuple = defs.get(loop.operands[0]) if loop.operands else None
    if init_tuple is None or init_tuple.opcode != "tuple" or k >= len(init_tuple.operands):
        return 1
    start = _constant(init_tuple.operands[k], defs)
    step = _step(comps.get(loop.attr("body") or "", []), k)
    if start is None or not step:
        return 1
    span = bound - start + (1 if direction and direction.group(1) == "LE" else 0)
    return max(0, math.ceil(span / step))


def _step(body: list[Instr], k: int) -> int | None:
    """How much the body adds to the loop tuple's element ``k`` (None if not a constant)."""
    defs = {i.name: i for i in body}
    root = next((i for i in body if i.root), None)
    if root is None or root.opcode != "tuple" or k >= len(root.operands):
        return None
    nxt = defs.get(root.operands[k])
    while nxt is not None and nxt.opcode in ("copy", "bitcast") and nxt.operands:
        nxt = defs.get(nxt.operands[0])
    if nxt is None or nxt.opcode != "add":
        return None
    for x, y in (nxt.operands, reversed(nxt.operands)):
        if _tuple_index(x, defs) == k:
            return _constant(y, defs)
    return None


def group_size(line: str) -> int:
    groups = replica_groups(line)
    return len(groups[0]) if groups else 1


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """``[4,2]T(1,0)``: iota over ``dims``, transposed by ``perm``, flattened."""
    shape = [int(x) for x in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    if perm:
        ids = ids.transpose([int(x) for x in perm.split(",")])
    return ids.reshape(-1)


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r"\s*\{([^}]*)\}")


def replica_groups(line: str) -> list[list[int]] | None:
    """The replica groups of a collective; None for all devices.

    Three spellings: explicit (``{{0,2},{1,3}}``), iota (``[2,2]<=[4]``, ``[2,4]<=[4,2]T(1,0)``)
    and mesh (``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``, optionally with
    ``device_ids=([4,2]T(1,0))``: a group per coordinate of the axes not listed).
    """
    m = _MESH_GROUPS.search(line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(k) for _, k in axes]
        ids = _iota(m.group(2), m.group(3)) if m.group(2) else np.arange(int(np.prod(sizes)))
        reduced = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(4)]
        kept = [i for i in range(len(axes)) if i not in reduced]
        grid = ids.reshape(sizes).transpose(kept + reduced)
        return grid.reshape(-1, int(np.prod([sizes[i] for i in reduced]))).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        n_groups = int(m.group(1).split(",")[0])
        return _iota(m.group(2), m.group(3)).reshape(n_groups, -1).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
    if m and m.group(1):
        groups = re.findall(r"\{([\d,]*)\}", m.group(1))
        return [[int(x) for x in g.split(",") if x] for g in groups]
    return None


def axes_of(line: str, mesh_axes: dict[str, int]) -> str:
    """``data``, ``model``, ``data+model``... : the mesh axes one collective's groups span."""
    groups = replica_groups(line)
    names, sizes = list(mesh_axes), list(mesh_axes.values())
    if groups is None:  # every device
        spanned = [n for n, k in zip(names, sizes, strict=True) if k > 1]
    else:
        spanned = []
        for i, name in enumerate(names):
            for g in groups:
                coords = {np.unravel_index(d, sizes)[i] for d in g if d < np.prod(sizes)}
                if len(coords) > 1:
                    spanned.append(name)
                    break
    return "+".join(spanned) or "none"


def link_of(line: str, hosts: list[int]) -> str:
    """``intra_host`` when every replica group of a collective stays on one host, else
    ``inter_host``; ``hosts[d]`` is the host of logical device ``d`` (the mesh's flat order).

    A collective with a group that spans hosts is counted whole as inter-host: a ring over such
    a group crosses the host boundary with every byte it moves.
    """
    groups = replica_groups(line)
    if groups is None:
        groups = [list(range(len(hosts)))]
    spans = any(len({hosts[d] for d in g if d < len(hosts)}) > 1 for g in groups)
    return "inter_host" if spans else "intra_host"
