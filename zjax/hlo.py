"""Collective traffic read off a compiled program's HLO text.

Loop bodies are weighted by their trip count (``known_trip_count`` in the while's backend
config), so a scan over L layers counts each per-layer collective L times. Given the mesh's axis
sizes, each collective is also attributed to the mesh axes its replica groups span (device ids
in a jit-compiled SPMD program are positions in the mesh's row-major device order).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

__all__ = ["CollectiveBytes", "UnorderedPair", "collective_bytes", "unordered_collectives"]

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}
_KINDS = {"all-gather": "all_gather", "all-gather-start": "all_gather",
          "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce",
          "all-reduce-start": "all_reduce", "all-to-all": "all_to_all",
          "collective-permute": "collective_permute",
          "collective-permute-start": "collective_permute"}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([\w\-]+)\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
    """Bytes of tensors moved by each kind of collective in one execution of a program.

    All-gather and reduce-scatter count the full (gathered / pre-scatter) tensor; all-reduce
    counts its tensor once (``wire`` counts it twice, as a ring all-reduce moves it twice).
    """

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    all_to_all: int = 0
    collective_permute: int = 0
    counts: dict = dataclasses.field(default_factory=dict)
    by_axis: dict = dataclasses.field(default_factory=dict)

    @property
    def wire(self) -> int:
        return (self.all_gather + self.reduce_scatter + 2 * self.all_reduce + self.all_to_all
                + self.collective_permute)

    def as_dict(self) -> dict:
        return {"all_gather_bytes": self.all_gather, "reduce_scatter_bytes": self.reduce_scatter,
                "all_reduce_bytes": self.all_reduce, "all_to_all_bytes": self.all_to_all,
                "collective_permute_bytes": self.collective_permute, "wire_bytes": self.wire,
                "counts": dict(self.counts), "by_axis": dict(self.by_axis)}


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            total += n * _DTYPE_BYTES[dtype]
    return total


def _group_size(line: str) -> int:
    groups = _groups(line)
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


def _groups(line: str) -> list[list[int]] | None:
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


def _axes_of(line: str, mesh_axes: dict[str, int]) -> str:
    """``data``, ``model``, ``data+model``... : the mesh axes one collective's groups span."""
    groups = _groups(line)
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


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """The module's computations (name -> instruction lines) and the ENTRY's name."""
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line.strip())
        if m and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def collective_bytes(hlo_text: str, *, mesh_axes: dict[str, int] | None = None
                     ) -> CollectiveBytes:
    """Sum collective tensor bytes of a compiled module (``compiled.as_text()``).

    Args:
      hlo_text: the compiled module's text.
      mesh_axes: the mesh's axis sizes in order (``dict(mesh.shape)``): fills ``by_axis``,
        ``{axes: {kind: bytes}}`` per combination of mesh axes a collective spans.
    """
    comps, entry = _computations(hlo_text)
    weight: dict[str, float] = defaultdict(float)

    def visit(name: str, w: float, depth: int = 0) -> None:
        if name not in comps or depth > 64:
            return
        weight[name] += w
        for line in comps[name]:
            trips = 1
            if " while(" in line:
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trips = int(t.group(1)) if t else 1
                body = re.search(r"body=%?([\w.\-]+)", line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                if body:
                    visit(body.group(1), w * trips, depth + 1)
                if cond:
                    visit(cond.group(1), w * (trips + 1), depth + 1)
                continue
            for key in ("calls", "to_apply"):
                for callee in re.findall(rf"{key}=%?([\w.\-]+)", line):
                    visit(callee, w, depth + 1)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                for callee in branches.group(1).split(","):
                    visit(callee.strip().lstrip("%"), w, depth + 1)

    visit(entry, 1.0)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    by_axis: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, w in weight.items():
        for line in comps[name]:
            m = _OP.match(_COMMENT.sub("", line))
            if not m or m.group(2) not in _KINDS:
                continue
            kind = _KINDS[m.group(2)]
            nbytes = _shape_bytes(m.group(1))
            if m.group(2).endswith("-start"):
                nbytes //= 2  # async start returns (operand, result)
            if kind == "reduce_scatter":
                nbytes *= _group_size(line)
            sums[kind] += w * nbytes
            counts[kind] += w
            if mesh_axes:
                by_axis[_axes_of(line, mesh_axes)][kind] += w * nbytes
    return CollectiveBytes(**{k: int(v) for k, v in sums.items()},
                           counts={k: int(v) for k, v in counts.items()},
                           by_axis={a: {k: int(v) for k, v in d.items()}
                                    for a, d in sorted(by_axis.items())})


@dataclasses.dataclass(frozen=True)
class UnorderedPair:
    """Two instructions of one computation that may run collectives of one kind at once.

    ``first`` or ``second`` (or both) is a loop, call or conditional whose body holds the
    collectives; ``kinds`` are the collective kinds the two have in common (over the same
    device groups).
    """

    computation: str
    first: str
    second: str
    kinds: tuple[str, ...]


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CALLEES = re.compile(r"\b(?:body|condition|calls|to_apply)=%?([\w.\-]+)")


def _operands(line: str, start: int) -> set[str]:
    """Names in the balanced parentheses opening at ``line[start]``, and control predecessors."""
    depth, end = 0, len(line)
    for i in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            end = i
            break
    names = set(re.findall(r"%([\w.\-]+)", line[start:end]))
    preds = re.search(r"control-predecessors=\{([^}]*)\}", line)
    if preds:
        names |= {n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", preds.group(1))}
    return names


def unordered_collectives(hlo_text: str) -> list[UnorderedPair]:
    """Pairs of collectives of one kind that XLA:CPU may run at the same time on one device.

    XLA:CPU runs the collectives of one computation in program order, but a loop's (or
    call's) body runs in its own executor: nothing orders the collectives inside it against
    the collectives around it except data dependencies. Every collective JAX emits has channel
    id 1, so two all-gathers over the same devices running at once share XLA's rendezvous key:
    the run aborts (``Id can't be larger than the number of participating threads``) or hangs.
    This lists each such pair: same computation, at least one side a loop, call or
    conditional, a collective of the same kind over the same device groups in common, and
    neither reachable from the other through operands or control predecessors. A step that is
    safe on XLA:CPU has none.
    """
    comps, _ = _computations(hlo_text)
    sigs_of: dict[str, frozenset[tuple[str, str]]] = {}  # a computation's collectives, nested

    def sigs_in(name: str, depth: int = 0) -> frozenset[tuple[str, str]]:
        if name not in sigs_of:
            sigs_of[name] = frozenset()  # cycles cannot occur; this guards bad text
            found: set[tuple[str, str]] = set()
            for line in comps.get(name, ()):
                op = _OP.match(_COMMENT.sub("", line))
                if op and op.group(2) in _KINDS:
                    found.add(_signature(op.group(2), line))
                elif depth < 64:
                    for callee in _callees(line):
                        found |= sigs_in(callee, depth + 1)
            sigs_of[name] = frozenset(found)
        return sigs_of[name]

    pairs = []
    for comp, lines in comps.items():
        index: dict[str, int] = {}
        ancestors: list[int] = []  # bitset of instruction indices each one depends on
        units: list[tuple[int, str, frozenset[tuple[str, str]], bool]] = []
        for raw in lines:
            line = _COMMENT.sub("", raw)
            name, op = _NAME.match(line), _OP.match(line)
            if not name or not op:
                continue
            i = len(ancestors)
            index[name.group(1)] = i
            bits = 0
            for dep in _operands(line, op.end() - 1):
                if dep in index:
                    bits |= ancestors[index[dep]] | (1 << index[dep])
            ancestors.append(bits)
            if op.group(2) in _KINDS:
                units.append((i, name.group(1), frozenset({_signature(op.group(2), line)}), False))
            else:
                nested = frozenset().union(*(sigs_in(c) for c in _callees(line)))
                if nested:
                    units.append((i, name.group(1), nested, True))
        for a, (i, first, sigs_a, nested_a) in enumerate(units):
            for j, second, sigs_b, nested_b in units[a + 1:]:
                common = sigs_a & sigs_b
                ordered = ancestors[j] >> i & 1 or ancestors[i] >> j & 1
                if common and (nested_a or nested_b) and not ordered:
                    kinds = tuple(sorted({kind for kind, _ in common}))
                    pairs.append(UnorderedPair(comp, first, second, kinds))
    return pairs


def _signature(opcode: str, line: str) -> tuple[str, str]:
    """What XLA:CPU's rendezvous key tells collectives apart by: kind and device groups."""
    groups = _groups(line)
    return _KINDS[opcode], "all" if groups is None else repr(sorted(map(sorted, groups)))


def _callees(line: str) -> list[str]:
    names = _CALLEES.findall(line)
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        names += [c.strip().lstrip("%") for c in branches.group(1).split(",")]
    return names
