"""``zjax plan --longest-seq``: the longest sequence a config trains on, one per device.

Each length tried is compiled (nothing allocated) and judged by the compiled step's device
total against the budget (a target's device memory by default): lengths double from ``step``
while they fit, then bisect between the last that fit and the first that did not, to a
multiple of ``step``. The config's other settings (attention kernel, activation offload,
mesh) stay as given, so ``zero.offload_activations=true`` asks the same question with the
saved inputs in host memory.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from zjax.config import Config
from zjax.errors import ConfigError
from zjax.planning._memory import format_bytes as _size
from zjax.planning._report import PlanReport

__all__ = ["LongestResult", "longest_sequence"]

# 2^24 tokens: a bound on the doubling (no device holds a sequence this long today)
_LIMIT = 1 << 24


@dataclasses.dataclass(frozen=True)
class LongestResult:
    """The answer of :func:`longest_sequence`.

    Attributes:
      seq_len: the longest length that fits (0 when not even ``step`` does).
      report: the plan at ``seq_len`` (None when nothing fits).
      tried: ``(seq_len, total_bytes or None, fits)`` of every length compiled, in order
        (None: the compiler refused the program as too large).
      budget_bytes: the budget per device.
      context: the devices each sequence is split over (``mesh.context``).
    """

    seq_len: int
    report: PlanReport | None
    tried: list[tuple[int, int | None, bool]]
    budget_bytes: int
    context: int = 1

    def table(self) -> str:
        where = "device" if self.context == 1 else f"{self.context} devices (mesh.context)"
        head = (f"longest sequence per {where}: {self.seq_len:,} tokens"
                if self.seq_len else "no sequence length tried fits")
        lines = [f"{head} (budget {_size(self.budget_bytes)} per device)",
                 f"  {'seq_len':>10}{'device total':>16}  fits"]
        for seq, total, fits in sorted(self.tried):
            shown = "refused" if total is None else _size(total)
            lines.append(f"  {seq:>10,}{shown:>16}  {'yes' if fits else 'no'}")
        return "\n".join(lines)


def at_length(config: Config, seq_len: int, sequences: int) -> Config:
    """``config`` at one ``seq_len`` sequence per data-parallel rank, no micro-batching."""
    model = config.model
    if hasattr(model, "max_seq_len"):
        model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq_len))
    return dataclasses.replace(
        config, model=model,
        data=dataclasses.replace(config.data, seq_len=seq_len, batch_size=sequences),
        train=dataclasses.replace(config.train, grad_accum=1))


def longest_sequence(config: Config, *, compile_report: Callable[[Config], PlanReport],
                     budget_bytes: int, sequences: int, step: int = 1024,
                     progress: Callable[[str], None] | None = None) -> LongestResult:
    """The longest multiple of ``step`` at which ``config`` fits ``budget_bytes`` per device.

    Args:
      config: the configuration (its batch, length and micro-batching are replaced).
      compile_report: ``compile_report(config) -> PlanReport``; a ConfigError saying "does
        not fit" (a compiler that refuses an oversized program) counts as not fitting.
      budget_bytes: device memory per device.
      sequences: the global batch: one sequence per data-parallel rank.
      step: the granularity (a multiple of the attention kernel's block).
      progress: called with a line per length compiled.
    """
    if step < 1:
        raise ConfigError(f"--seq-step: must be >= 1, got {step}")
    tried: list[tuple[int, int | None, bool]] = []
    reports: dict[int, PlanReport] = {}

    def fits(seq: int) -> bool:
        start = time.perf_counter()
        try:
            r = compile_report(at_length(config, seq, sequences))
        except ConfigError as e:
            if "does not fit" not in str(e):
                raise
            tried.append((seq, None, False))
        else:
            reports[seq] = r
            tried.append((seq, r.per_device["total_bytes"], r.fits(budget_bytes)))
        if progress is not None:
            total = tried[-1][1]
            progress(f"seq_len {seq:,}: {'refused' if total is None else _size(total)} "
                     f"per device, {'fits' if tried[-1][2] else 'does not fit'} "
                     f"({time.perf_counter() - start:.1f} s)")
        return tried[-1][2]

    lo, hi = 0, step
    while hi <= _LIMIT and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return LongestResult(lo, reports.get(lo), tried, budget_bytes, config.mesh.context)
