"""The matmuls of a compiled step, read from its HLO: how many run with FP8 operands and their
share of the matmul FLOPs (``model.fp8``).

A matmul is a ``dot`` (in any computation: a fusion's, a Triton GEMM fusion's, a loop body's)
or a cuBLAS GEMM custom call; it runs in FP8 when both operands are ``f8e4m3fn``/``f8e5m2``
where the GEMM reads them (not a quantize-dequantize pair around a 16-bit GEMM). Loops count
their trip count times, so a layer scan's GEMMs count once per layer, and a recomputed forward
(remat) once more.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import NamedTuple

from zjax.planning._hlo_text import Instr, parse_module

__all__ = ["Matmul", "matmul_figures", "matmul_lines", "matmuls"]

_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


def _dims(shape: str) -> tuple[str, list[int]] | None:
    m = _SHAPE.search(shape)
    if m is None:
        return None
    return m.group(1), [int(d) for d in m.group(2).split(",") if d]


def _contracting(instr: Instr) -> list[int] | None:
    """The left operand's contracting dimensions of a matmul instruction (None: not one)."""
    if instr.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.line)
        return [int(d) for d in m.group(1).split(",") if d] if m else []
    if instr.opcode == "custom-call" and any(f'"{t}' in instr.line for t in _GEMM_TARGETS):
        m = re.search(r"backend_config=(\{.*\})", instr.line)
        try:
            dims = json.loads(m.group(1))["gemm_backend_config"]["dot_dimension_numbers"]
            return [int(d) for d in dims["lhs_contracting_dimensions"]]
        except (AttributeError, KeyError, ValueError):
            return None
    return None


class Matmul(NamedTuple):
    """One matmul of a compiled step: operand and result dims, FLOPs per run, runs per step
    (loops by trip count), whether both operands are FP8."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    result: tuple[int, ...]
    flops: float
    runs: float
    fp8: bool


def matmuls(texts: Iterable[tuple[str, int]] | str) -> list[Matmul]:
    """Every matmul of the compiled HLO ``texts`` (a text, or ``(text, runs per step)``
    pairs)."""
    out = []
    for text, runs in ([(texts, 1)] if isinstance(texts, str) else texts):
        module = parse_module(text)
        for comp, weight in module.weights().items():
            defs = {i.name: i for i in module.comps[comp]}
            for instr in module.comps[comp]:
                contracting = _contracting(instr)
                operands = [defs.get(n) for n in instr.operands[:2]]
                if contracting is None or None in operands:
                    continue
                (ldt, lhs), (rdt, rhs) = (_dims(o.shape) or ("", []) for o in operands)
                _, result = _dims(instr.shape) or ("", [])
                flops = 2.0 * math.prod(result) * math.prod(lhs[d] for d in contracting)
                out.append(Matmul(tuple(lhs), tuple(rhs), tuple(result), flops, weight * runs,
                                  ldt.startswith("f8") and rdt.startswith("f8")))
    return out


def matmul_figures(texts: Iterable[tuple[str, int]] | str) -> dict[str, float]:
    """``matmuls``, ``fp8_matmuls`` (runs per step) and ``matmul_flops``, ``fp8_flops`` of
    the compiled HLO ``texts`` (as :func:`matmuls` takes them)."""
    found = matmuls(texts)
    return {"matmuls": sum(m.runs for m in found),
            "fp8_matmuls": sum(m.runs for m in found if m.fp8),
            "matmul_flops": sum(m.runs * m.flops for m in found),
            "fp8_flops": sum(m.runs * m.flops for m in found if m.fp8)}


def matmul_lines(m: dict[str, float]) -> list[str]:
    """The report's line: FP8 matmuls of the step's matmuls and their share of its FLOPs."""
    if not m.get("matmuls") or not m.get("fp8_matmuls"):
        return []
    share = m["fp8_flops"] / m["matmul_flops"] if m["matmul_flops"] else 0.0
    return [f"  FP8 matmuls: {m['fp8_matmuls']:,.0f} of {m['matmuls']:,.0f} per step, "
            f"{share:.0%} of the matmul FLOPs"]
