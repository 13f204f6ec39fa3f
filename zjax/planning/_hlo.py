"""Collective traffic and its overlap with compute, read off a compiled program's HLO text.

Loop bodies are weighted by their trip count, so a scan over L layers counts each per-layer
collective L times. Given the mesh's axis sizes, each collective is also attributed to the mesh
axes its replica groups span (device ids in a jit-compiled SPMD program are positions in the
mesh's row-major device order). The three backends' spellings are read alike
(``_hlo_text``): synchronous collectives (XLA:CPU, TPU), ``*-start``/``*-done`` pairs
(GPU) and TPU's async collective fusions (counted once, at their start). TPU often writes a
reduce-scatter as an all-reduce whose result is dynamic-sliced, and a small all-gather as an
all-reduce of a zero-padded buffer: with ``decomposed=True`` both are counted as what they are,
and their extra traffic is in ``wire``. The collective-permutes of zjax's ring reduce-scatter
(:func:`zjax.partition.gather.reduce_scatter`, ``method="ring"``; named by its scope in the
instructions' metadata) are counted as the one reduce-scatter they make.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from zjax.planning._hlo_order import UnorderedPair, unordered_collectives
from zjax.planning._hlo_text import KINDS as _KINDS
from zjax.planning._hlo_text import (
    Instr,
    Module,
    axes_of,
    group_size,
    link_of,
    parse_module,
    replica_groups,
    shape_bytes,
    tuple_elements,
)

__all__ = ["CollectiveBytes", "CollectiveSite", "UnorderedPair", "collective_bytes",
           "collective_sites", "unordered_collectives"]

# zjax.partition.gather.RING_SCOPE: the op_name scope of a ring reduce-scatter's permutes
_RING_SCOPE = "zjax_ring_reduce_scatter"
_RING_SIZES = re.compile(_RING_SCOPE + r"_n(\d+)_h(\d+)")
_START_SHAPE_RESULT = {"all-gather", "reduce-scatter", "collective-permute"}  # (operand, result)
# instructions that are not compute: moving, viewing or waiting on data
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy",
                "copy-start", "copy-done", "opt-barrier", "partition-id", "replica-id",
                "after-all", "send", "send-done", "recv", "recv-done", "add-dependency",
                "domain", "iota"}


def _kind(opcode: str) -> tuple[str | None, str]:
    """``(kind, "sync"|"start"|"done")`` of an opcode; kind None for other opcodes."""
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix) and opcode.removesuffix(suffix) in _KINDS:
            return _KINDS[opcode.removesuffix(suffix)], suffix[1:]
    return _KINDS.get(opcode), "sync"


def _is_tpu_async(instr: Instr) -> bool:
    """A TPU async collective fusion's continuation or done (they hold copies of it)."""
    return instr.name.startswith("async-collective-done") or any(
        c.startswith("async_collective_fusion") for c in instr.callees)


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
    """Bytes of tensors moved by each kind of collective in one execution of a program.

    All-gather and reduce-scatter count the full (gathered / pre-scatter) tensor; all-reduce
    counts its tensor once. ``wire`` is what a ring moves: an all-reduce twice, and so the
    reduce-scatters and all-gathers the compiler ran as all-reduces (``*_via_all_reduce``).
    ``overlap`` is, per kind, the fraction of bytes whose collective has compute scheduled
    between its start and its done (see :func:`collective_sites`).
    """

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    all_to_all: int = 0
    collective_permute: int = 0
    reduce_scatter_via_all_reduce: int = 0
    all_gather_via_all_reduce: int = 0
    counts: dict = dataclasses.field(default_factory=dict)
    by_axis: dict = dataclasses.field(default_factory=dict)
    overlap: dict = dataclasses.field(default_factory=dict)
    by_link: dict = dataclasses.field(default_factory=dict)

    @property
    def wire(self) -> int:
        return (self.all_gather + self.reduce_scatter + 2 * self.all_reduce + self.all_to_all
                + self.collective_permute + self.reduce_scatter_via_all_reduce
                + self.all_gather_via_all_reduce)

    def as_dict(self) -> dict:
        return {"all_gather_bytes": self.all_gather, "reduce_scatter_bytes": self.reduce_scatter,
                "all_reduce_bytes": self.all_reduce, "all_to_all_bytes": self.all_to_all,
                "collective_permute_bytes": self.collective_permute, "wire_bytes": self.wire,
                "reduce_scatter_via_all_reduce_bytes": self.reduce_scatter_via_all_reduce,
                "all_gather_via_all_reduce_bytes": self.all_gather_via_all_reduce,
                "counts": dict(self.counts), "by_axis": dict(self.by_axis),
                "overlap": dict(self.overlap)}


@dataclasses.dataclass(frozen=True)
class CollectiveSite:
    """One collective of a compiled module, as scheduled.

    Attributes:
      kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ...: what it computes (an
        all-reduce whose result is dynamic-sliced is a ``reduce_scatter``).
      nbytes: tensor bytes per execution (gathered / pre-scatter size).
      weight: executions per step (loop trip counts multiplied); each of a ring
        reduce-scatter's ``h`` hops carries ``1 / h`` of the ring's.
      computation: the scheduled computation it runs in.
      name: its instruction there (the start of an async pair, or the TPU fusion).
      overlapped: whether compute is scheduled between its start and its done.
      via_all_reduce: it runs as an all-reduce (twice the wire bytes of a ring).
      line: the collective's HLO line (replica groups).
    """

    kind: str
    nbytes: int
    weight: float
    computation: str
    name: str
    overlapped: bool
    via_all_reduce: bool
    line: str


_PASS_THROUGH = ("get-tuple-element", "bitcast", "copy", "copy-start", "copy-done")


def _users(instrs: list[Instr]) -> dict[str, list[int]]:
    users: dict[str, list[int]] = defaultdict(list)
    for i, instr in enumerate(instrs):
        for op in instr.operands:
            users[op].append(i)
    return users


def _through_tuples(name: str, instrs: list[Instr], users: dict[str, list[int]]) -> list[Instr]:
    """The users of ``name``, looking through tuples, bitcasts and copies (TPU moves values
    between memories with ``copy-start``/``copy-done``)."""
    out, todo, seen = [], [name], set()
    while todo:
        for i in users.get(todo.pop(), ()):
            if i in seen:
                continue
            seen.add(i)
            if instrs[i].opcode in _PASS_THROUGH:
                todo.append(instrs[i].name)
            else:
                out.append(instrs[i])
    return out


def _elements(instr: Instr, instrs: list[Instr], users: dict[str, list[int]]
              ) -> list[tuple[str, list[Instr]]]:
    """``(shape, users)`` of each element of a (tuple-shaped) instruction's result."""
    elements = tuple_elements(instr.shape)
    if len(elements) == 1 and not instr.shape.lstrip().startswith("("):
        return [(elements[0], _through_tuples(instr.name, instrs, users))]
    by_index: dict[int, list[Instr]] = defaultdict(list)
    for i in users.get(instr.name, ()):
        gte = instrs[i]
        m = re.search(r"index=(\d+)", gte.line)
        if gte.opcode == "get-tuple-element" and m:
            by_index[int(m.group(1))] += _through_tuples(gte.name, instrs, users)
    return [(e, by_index[k]) for k, e in enumerate(elements)]


def _outside(name: str, comp: str, caller: Instr, module: Module) -> str:
    """``name`` as the caller sees it: a fused computation's ``parameter(i)`` is the
    fusion's i-th operand (a TPU async collective fusion gathers what it is handed)."""
    for instr in module.comps.get(comp, ()):
        if instr.name == name and instr.opcode == "parameter":
            m = re.search(r"parameter\((\d+)\)", instr.line)
            if m and int(m.group(1)) < len(caller.operands):
                return caller.operands[int(m.group(1))]
    return name


def _made_by(name: str, defs: dict[str, Instr], opcode: str, module: Module) -> bool:
    """Whether ``name`` comes from ``opcode``, looking back through copies, bitcasts and
    single-operand custom calls (TPU's ``ZeroCrop``)."""
    instr = defs.get(name)
    for _ in range(16):
        if instr is None:
            return False
        if _has_op(module, instr, opcode):
            return True
        if not (instr.opcode in _PASS_THROUGH[1:] or instr.opcode == "custom-call") \
                or len(instr.operands) != 1:
            return False
        instr = defs.get(instr.operands[0])
    return False


def _has_op(module: Module, instr: Instr | None, opcode: str) -> bool:
    if instr is None:
        return False
    if instr.opcode == opcode:
        return True
    return instr.opcode == "fusion" and any(
        i.opcode == opcode for c in instr.callees for i in module.comps.get(c, ()))


def _is_compute(instr: Instr) -> bool:
    if instr.opcode in _NOT_COMPUTE or _kind(instr.opcode)[0] is not None:
        return False
    return not instr.name.startswith(("async-collective-start", "async-collective-done"))


def _done_index(instrs: list[Instr], start: int, users: dict[str, list[int]]) -> int | None:
    """Where the async collective started at ``start`` completes in the same computation."""
    name = instrs[start].name
    tpu = name.startswith("async-collective-start")
    todo, seen = [name], set()
    while todo:
        for i in users.get(todo.pop(), ()):
            if i in seen:
                continue
            seen.add(i)
            instr = instrs[i]
            if (tpu and instr.name.startswith("async-collective-done")) or (
                    not tpu and instr.opcode.endswith("-done")):
                return i
            if tpu and (instr.opcode == "get-tuple-element" or _is_tpu_async(instr)):
                todo.append(instr.name)
    return None


def _ring_length(line: str) -> int:
    """The length of the cycle through the first source of a permute's ``source_target_pairs``."""
    pairs = dict(tuple(p) for p in replica_groups(line) or () if len(p) == 2)
    if not pairs:
        return 1
    start = node = next(iter(pairs))
    for n in range(1, len(pairs) + 1):
        node = pairs.get(node, start)
        if node == start:
            return n
    return len(pairs)


def _ring_hop(line: str, nbytes: int, weight: float) -> tuple[float, float]:
    """``(bytes, weight)`` of one hop of a ring reduce-scatter, a hop moving ``nbytes``: its
    share of the reduce-scatter's full tensor. The scope names the ring's devices ``n`` and
    hops ``h`` (rings within rings: hops of several sizes); the ``n - 1`` hops of one ring
    together move ``(n - 1) / n`` of the tensor, so each hop counts ``nbytes x n / (n - 1)``
    bytes, ``1 / h`` of one reduce-scatter."""
    m = _RING_SIZES.search(line)
    if m:
        n, h = int(m.group(1)), int(m.group(2))
    else:  # one ring of the cycle's length (the scope of older programs)
        n = _ring_length(line)
        h = n - 1
    h = max(1, h)
    return nbytes * n / max(1, n - 1) * h, weight / h


def _bytes_and_overlap(instr: Instr, phase: str, instrs: list[Instr], site: int,
                       users) -> tuple[int, bool]:
    """A collective's tensor bytes, and whether compute is scheduled between its start and
    its done (a synchronous one, or one never done in its computation: False)."""
    nbytes = shape_bytes(instr.shape)
    done = None
    fused_async = instrs[site].name.startswith("async-collective-start")
    if phase == "start" or fused_async:
        done = _done_index(instrs, site, users)
        if phase == "start" and done is not None:
            nbytes = shape_bytes(instrs[done].shape)
        elif phase == "start" and instr.opcode.removesuffix("-start") in _START_SHAPE_RESULT:
            nbytes = shape_bytes(tuple_elements(instr.shape)[1])
    if instr.opcode.startswith("ragged-all-to-all"):
        nbytes = min(nbytes, _ragged_operand_bytes(instr, phase, instrs))
    stop = len(instrs) if done is None else done
    overlapped = done is not None or phase == "start" or fused_async
    return nbytes, overlapped and any(_is_compute(x) for x in instrs[site + 1:stop])


def _ragged_operand_bytes(instr: Instr, phase: str, instrs: list[Instr]) -> int:
    """The rows a ragged all-to-all can send: its operand (the result is a buffer for the
    worst-case arrivals, so the smaller of the two bounds what it moves). An async start's
    shape holds its operands first; a synchronous one's operand is defined beside it."""
    if phase == "start":
        return shape_bytes(tuple_elements(tuple_elements(instr.shape)[0])[0])
    operand = next((i for i in instrs if instr.operands and i.name == instr.operands[0]), None)
    return shape_bytes(tuple_elements(operand.shape)[0]) if operand is not None else 1 << 62


def _decomposed(module, comp: str, instr: Instr, instrs: list[Instr], site: int, users,
                defs: dict[str, Instr]) -> list[tuple[str, int, bool]]:
    """``(kind, bytes, via all-reduce)`` per element of a TPU all-reduce: a reduce-scatter
    where only dynamic slices use it, an all-gather where it sums a dynamic-update-sliced
    unsigned buffer (zjax's gathers move uint bits), else an all-reduce."""
    out = []
    for k, (element, users_of_element) in enumerate(_elements(instr, instrs, users)):
        kind, via = "all_reduce", False
        if re.search(r"\[\d", element) and any(
                _has_op(module, u, "dynamic-slice") for u in users_of_element):
            kind, via = "reduce_scatter", True
        elif element.startswith("u") and k < len(instr.operands) and _made_by(
                _outside(instr.operands[k], comp, instrs[site], module), defs,
                "dynamic-update-slice", module):
            kind, via = "all_gather", True
        out.append((kind, shape_bytes(element), via))
    return out


def collective_sites(hlo_text: str, *, decomposed: bool = False) -> list[CollectiveSite]:
    """Every collective of a compiled module with its bytes, weight and overlap.

    With ``decomposed`` (a TPU program: ``Backend.decomposes_collectives``) an all-reduce
    whose result is only dynamic-sliced is read as a reduce-scatter, and an all-reduce of a
    dynamic-update-sliced unsigned buffer as an all-gather (zjax gathers move uint bits).
    """
    module = parse_module(hlo_text)
    weights = module.weights(skip=_is_tpu_async)
    callers: dict[str, tuple[str, int]] = {}  # fused computation -> (computation, index)
    for comp, instrs in module.comps.items():
        for i, instr in enumerate(instrs):
            if instr.opcode == "fusion":
                for c in instr.callees:
                    callers[c] = (comp, i)
    users_of = {comp: _users(instrs) for comp, instrs in module.comps.items()}
    defs_of: dict[str, dict[str, Instr]] = {}
    sites = []
    for comp, w in weights.items():
        for index, instr in enumerate(module.comps[comp]):
            kind, phase = _kind(instr.opcode)
            if kind is None or phase == "done":
                continue
            site_comp, site = comp, index
            if comp in callers:  # inside a fusion (TPU async collective): the fusion is the site
                site_comp, site = callers[comp]
            instrs, users = module.comps[site_comp], users_of[site_comp]
            nbytes, overlapped = _bytes_and_overlap(instr, phase, instrs, site, users)
            site_name = instrs[site].name
            if kind == "reduce_scatter":
                nbytes *= group_size(instr.line)
            site_weight = w
            if kind == "collective_permute" and _RING_SCOPE in instr.line:
                kind, nbytes, site_weight = "reduce_scatter", *_ring_hop(instr.line, nbytes, w)
            if (kind != "all_reduce" or phase != "sync" or not decomposed
                    or group_size(instr.line) == 1):
                sites.append(CollectiveSite(kind, nbytes, site_weight, site_comp, site_name,
                                            overlapped, False, instr.line))
                continue
            # an all-reduce (a combined one: per tuple element) may be another collective
            if site_comp not in defs_of:
                defs_of[site_comp] = {i.name: i for i in instrs}
            sites += [CollectiveSite(el_kind, nbytes, w, site_comp, site_name, overlapped, via,
                                     instr.line)
                      for el_kind, nbytes, via in _decomposed(
                          module, comp, instr, instrs, site, users, defs_of[site_comp])]
    return sites


def collective_bytes(hlo_text: str | list[tuple[str, int]], *,
                     mesh_axes: dict[str, int] | None = None, decomposed: bool = False,
                     hosts: list[int] | None = None) -> CollectiveBytes:
    """Sum collective tensor bytes of a compiled module (``compiled.as_text()``).

    Args:
      hlo_text: the compiled module's text, or ``[(text, runs)]`` of programs run ``runs`` times.
      mesh_axes: the mesh's axis sizes in order (``dict(mesh.shape)``): fills ``by_axis``,
        ``{axes: {kind: bytes}}`` per combination of mesh axes a collective spans.
      decomposed: read TPU's decomposed collectives as what they are (see
        :func:`collective_sites`).
      hosts: the host of each logical device (the mesh's flat order): fills ``by_link``,
        ``{intra_host | inter_host: {kind: bytes}}`` (:func:`link_of`).
    """
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    hidden: dict[str, float] = defaultdict(float)
    by_axis: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_link: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    texts = [(hlo_text, 1)] if isinstance(hlo_text, str) else hlo_text
    for s, runs in [(s, runs) for text, runs in texts
                    for s in collective_sites(text, decomposed=decomposed)]:
        b = runs * s.weight * s.nbytes
        sums[s.kind] += b
        counts[s.kind] += runs * s.weight
        hidden[s.kind] += b if s.overlapped else 0
        if s.via_all_reduce:
            sums[f"{s.kind}_via_all_reduce"] += b
        if mesh_axes:
            by_axis[axes_of(s.line, mesh_axes)][s.kind] += b
        if hosts:
            by_link[link_of(s.line, hosts)][s.kind] += b
    overlap = {k: round(hidden[k] / v, 4) for k, v in sums.items()
               if v and k in _KINDS.values()}
    return CollectiveBytes(**{k: round(v) for k, v in sums.items()},
                           counts={k: round(v) for k, v in counts.items()},
                           by_axis={a: {k: int(v) for k, v in d.items()}
                                    for a, d in sorted(by_axis.items())},
                           overlap=overlap,
                           by_link={a: {k: int(v) for k, v in d.items()}
                                    for a, d in sorted(by_link.items())})
