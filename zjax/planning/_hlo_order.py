"""Which collectives XLA:CPU may run at once: a check of a compiled step's ordering."""

from __future__ import annotations

import dataclasses
import re

from zjax.planning._hlo_text import KINDS as _KINDS
from zjax.planning._hlo_text import Instr, parse_module, replica_groups

__all__ = ["UnorderedPair", "unordered_collectives"]


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


def _control_preds(line: str) -> set[str]:
    preds = re.search(r"control-predecessors=\{([^}]*)\}", line)
    return {n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", preds.group(1))} if preds else set()


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
    comps = parse_module(hlo_text).comps
    sigs_of: dict[str, frozenset[tuple[str, str]]] = {}  # a computation's collectives, nested

    def sigs_in(name: str, depth: int = 0) -> frozenset[tuple[str, str]]:
        if name not in sigs_of:
            sigs_of[name] = frozenset()  # cycles cannot occur; this guards bad text
            found: set[tuple[str, str]] = set()
            for instr in comps.get(name, ()):
                if instr.opcode in _KINDS:
                    found.add(_signature(instr))
                elif depth < 64:
                    for callee in instr.callees:
                        found |= sigs_in(callee, depth + 1)
            sigs_of[name] = frozenset(found)
        return sigs_of[name]

    pairs = []
    for comp, instrs in comps.items():
        index: dict[str, int] = {}
        ancestors: list[int] = []  # bitset of instruction indices each one depends on
        units: list[tuple[int, str, frozenset[tuple[str, str]], bool]] = []
        for i, instr in enumerate(instrs):
            index[instr.name] = i
            bits = 0
            for dep in set(instr.operands) | _control_preds(instr.line):
                if dep in index:
                    bits |= ancestors[index[dep]] | (1 << index[dep])
            ancestors.append(bits)
            if instr.opcode in _KINDS:
                units.append((i, instr.name, frozenset({_signature(instr)}), False))
            else:
                nested = frozenset().union(*(sigs_in(c) for c in instr.callees))
                if nested:
                    units.append((i, instr.name, nested, True))
        for a, (i, first, sigs_a, nested_a) in enumerate(units):
            for j, second, sigs_b, nested_b in units[a + 1:]:
                common = sigs_a & sigs_b
                ordered = ancestors[j] >> i & 1 or ancestors[i] >> j & 1
                if common and (nested_a or nested_b) and not ordered:
                    kinds = tuple(sorted({kind for kind, _ in common}))
                    pairs.append(UnorderedPair(comp, first, second, kinds))
    return pairs


def _signature(instr: Instr) -> tuple[str, str]:
    """What XLA:CPU's rendezvous key tells collectives apart by: kind and device groups."""
    groups = replica_groups(instr.line)
    return _KINDS[instr.opcode], "all" if groups is None else repr(sorted(map(sorted, groups)))
