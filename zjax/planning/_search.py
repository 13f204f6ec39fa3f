"""``zjax plan --budget``: the fitting configuration that exposes the least communication.

Every candidate tried is compiled (nothing allocated) and judged on its exact figures:
device memory, and the wire bytes of its collectives with the share no compute overlaps.
Collective bytes depend mostly on the stage, the number of micro-batches and the ``model``
axis size (offload, prefetch and remat move about the same), so the search ranks (stage,
grad_accum, model) groups by one compiled candidate each and walks them from the least
exposed (then least moved), trying each group's variants from the most to the least
preferred (least offload, no remat, deepest prefetch); the first variant that fits is the
answer. Groups with more micro-batches are compiled only when the walk reaches them (they
repeat the collectives per micro-batch). With estimates (:mod:`zjax.planning._estimate`)
a candidate that cannot fit is ruled out without its compile. DeepSpeed's autotuner runs
experiments instead.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import re
import time
from collections.abc import Callable, Sequence

from zjax.config import Config
from zjax.errors import ConfigError
from zjax.planning._candidates import ACTIVATIONS, OFFLOADS, Candidate, variants
from zjax.planning._estimate import Estimate
from zjax.planning._memory import format_bytes as _size
from zjax.planning._report import PlanReport

__all__ = ["ACTIVATIONS", "OFFLOADS", "Candidate", "TuneResult", "autotune", "exposed_bytes",
           "parse_bytes"]

# a candidate whose calibrated estimate exceeds the budget by more than this is not compiled
ESTIMATE_MARGIN = 0.10
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, *, key: str = "--budget") -> int:
    """``80GiB``, ``16 GB``, ``512MiB`` or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:  # also 1.5.5GB, inf, nan: no number of that form
        raise ConfigError(f"{key}: {text!r} is not a size; write e.g. 80GiB, 16GB, 512MiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"{key}: {text!r} is below one byte; write e.g. 80GiB, 16GB")
    return size


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The answer of :func:`autotune`.

    Attributes:
      config: the chosen configuration.
      report: its plan.
      rows: every candidate compiled, as ``(candidate, report)``; the fitting ones first,
        best first, then the rest by device memory.
      budget_bytes: the budget per device.
      notes: lines printed above the table (the base dtypes a search refused, and its own).
    """

    config: Config
    report: PlanReport
    rows: list[tuple[Candidate, PlanReport]]
    budget_bytes: int
    notes: tuple[str, ...] = ()

    def table(self) -> str:
        lines = [*self.notes, f"budget {_size(self.budget_bytes)} per device; best first:",
                 f"  {'fits':<5}{'model':>6}{'stage':>6}{'offload':>17}{'prefetch':>9}"
                 f"{'accum':>6}{'remat':>6}{'activations':>12}{'device total':>14}{'host':>12}"
                 f"{'wire/step':>13}{'not overlapped':>16}"]
        for cand, r in self.rows:
            lines.append(
                f"  {'yes' if r.fits(self.budget_bytes) else 'no':<5}{cand.model:>6}"
                f"{cand.stage:>6}"
                f"{cand.offload:>17}{cand.prefetch!s:>9}{cand.grad_accum:>6}"
                f"{cand.remat!s:>6}{cand.activations:>12}"
                f"{_size(r.per_device['total_bytes']):>14}"
                f"{_size(r.per_device['host_bytes']):>12}"
                f"{_size(r.collectives['wire_bytes']):>13}{_size(exposed_bytes(r)):>16}")
        return "\n".join(lines)


def _outcome(r: PlanReport, budget_bytes: int) -> str:
    total = r.per_device["total_bytes"]
    return (f"{_size(total)} per device, {'fits' if r.fits(budget_bytes) else 'does not fit'}; "
            f"wire {_size(r.collectives['wire_bytes'])}, {_size(exposed_bytes(r))} not "
            "overlapped")


class _Search:
    """The candidates compiled so far (each once), with a progress line per compile, and
    (with ``estimate``) those ruled out without a compile."""

    def __init__(self, config: Config, compile_report, budget_bytes: int, space: int,
                 progress: Callable[[str], None] | None,
                 estimate: Callable[[Config], Estimate] | None = None):
        self.config, self.compile_report, self.budget_bytes = config, compile_report, budget_bytes
        self.space, self.progress, self.estimate = space, progress, estimate
        self.seen: dict[Candidate, PlanReport | None] = {}
        self.rows: list[tuple[Candidate, PlanReport]] = []  # every one built, in order
        self.estimates: dict[Candidate, Estimate | None] = {}
        self.skipped: dict[Candidate, str] = {}  # ruled out by the estimate: why
        self.totals: dict[Candidate, int] = {}  # device totals compiled (or refused, libtpu)

    def estimate_of(self, cand: Candidate) -> Estimate | None:
        """``cand``'s estimate (None: no estimator, or it cannot be built)."""
        if self.estimate is None:
            return None
        if cand not in self.estimates:
            try:
                self.estimates[cand] = self.estimate(cand.apply(self.config))
            except ConfigError:
                self.estimates[cand] = None  # its compile says why
        return self.estimates[cand]

    def _factor(self, cand: Candidate) -> float | None:
        """The working-set factor measured on the compiled candidate most like ``cand``
        (the same stage, model axis, activations, offload, micro-batches: in that order),
        a refused compile's figure included."""
        alike = [(sum((c.stage == cand.stage, c.model == cand.model,
                       c.activations == cand.activations, c.offload == cand.offload,
                       c.grad_accum == cand.grad_accum)), i, self.estimates[c].factor(total))
                 for i, (c, total) in enumerate(self.totals.items())
                 if self.estimates.get(c) is not None]
        return max(alike)[2] if alike else None

    def ruled_out(self, cand: Candidate) -> bool:
        """Whether ``cand`` cannot fit by its estimate: its floor (state and kept inputs in
        device memory) over the budget, or its calibrated prediction over it by more than
        :data:`ESTIMATE_MARGIN`. Never compiled then (:meth:`say_ruled_out` says so)."""
        if cand in self.seen or (e := self.estimate_of(cand)) is None:
            return False
        if cand not in self.skipped:
            factor = self._factor(cand)
            if e.floor_bytes > self.budget_bytes:
                self.skipped[cand] = (f"needs at least {_size(e.floor_bytes)} (its state and "
                                      "kept layer inputs in device memory)")
            elif factor is not None and \
                    e.predicted(factor) > self.budget_bytes * (1 + ESTIMATE_MARGIN):
                self.skipped[cand] = f"estimated {_size(e.predicted(factor))}"
            else:
                return False
        return True

    def say_ruled_out(self, group: list[Candidate]) -> None:
        """One progress line for the candidates of ``group`` ruled out (the first one's
        reason)."""
        out = [c for c in group if c in self.skipped]
        if out and self.progress is not None:
            c = out[0]
            self.progress(f"[ruled out] model {c.model} stage {c.stage} accum {c.grad_accum}: "
                          f"{len(out)} of its {len(group)} candidates, not compiled (the first "
                          f"{self.skipped[c]})")

    def evaluate(self, cand: Candidate) -> PlanReport | None:
        """``cand``'s report, or None when it cannot be built (its build says why)."""
        if cand not in self.seen:
            start = time.perf_counter()
            try:
                self.seen[cand] = self.compile_report(cand.apply(self.config))
                self.rows.append((cand, self.seen[cand]))
                self.totals[cand] = self.seen[cand].per_device["total_bytes"]
                outcome = _outcome(self.seen[cand], self.budget_bytes)
            except ConfigError as e:
                self.seen[cand] = None
                outcome = f"cannot be built ({str(e).splitlines()[0][:120]})"
                temp, e_ = getattr(e, "temp_bytes", None), self.estimates.get(cand)
                if temp and e_ is not None:  # refused over the memory: its figure calibrates
                    self.totals[cand] = temp + e_.state_bytes
            if self.progress is not None:
                self.progress(f"[{len(self.seen)}/{max(self.space, len(self.seen))}] "
                              f"{cand.describe()}: {outcome} "
                              f"({time.perf_counter() - start:.1f} s)")
        return self.seen[cand]

    def nothing_fits(self, leanest: list[tuple[Candidate, PlanReport]]) -> ConfigError:
        if not leanest:  # every candidate ruled out by its floor, none compiled
            floors = [(e.floor_bytes, c) for c, e in self.estimates.items() if e is not None]
            least, c = min(floors, key=lambda fc: fc[0])
            return ConfigError(
                f"--budget: {_size(self.budget_bytes)} per device fits no configuration; the "
                f"smallest needs at least {_size(least)} (its state and kept layer inputs; "
                f"{c.describe()})")
        c, r = min(leanest, key=lambda cr: cr[1].per_device["total_bytes"])
        return ConfigError(
            f"--budget: {_size(self.budget_bytes)} per device fits no configuration; the "
            f"smallest needs {_size(r.per_device['total_bytes'])} (model {c.model}, stage "
            f"{c.stage}, offload {c.offload}, prefetch {c.prefetch}, grad_accum "
            f"{c.grad_accum}, remat {c.remat}, activations {c.activations})")


def _check_leanest(search: _Search, leans: list[list[Candidate]]) -> None:
    """Compile the leanest candidates first (per model size, the leanest that can be built:
    a backend without host memory cannot offload): if even they do not fit, nothing will."""
    built = []
    for options in leans:
        for c in options:
            if (r := search.evaluate(c)) is not None:
                built.append((c, r))
                break
    if built and not any(r.fits(search.budget_bytes) for _, r in built):
        raise search.nothing_fits(built)


def exposed_bytes(report) -> int:
    """A plan's wire bytes that no compute overlaps: its wire scaled by the share of its
    collectives' tensor bytes not overlapped (:class:`PlanReport` ``overlap``; XLA:CPU runs
    every collective synchronously: all of its wire)."""
    c, overlap = report.collectives, getattr(report, "overlap", None) or {}
    kinds = {k: c.get(f"{k}_bytes", 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    total = sum(kinds.values())
    hidden = sum(overlap.get(k, 0.0) * b for k, b in kinds.items())
    return round(c["wire_bytes"] * (1 - hidden / total)) if total else c["wire_bytes"]


def _best_first(search: _Search, groups: dict[tuple[int, int], list[int]], variants,
                runners_up: int) -> list[tuple[Candidate, PlanReport]]:
    """The fitting candidate of the group that exposes the least communication (then moves
    the least), and up to ``runners_up`` fits of other groups already compiled.

    Best-first over (stage, grad_accum, model) groups. A group taken from the heap is walked
    from its most preferred variant to the first that fits (those ruled out by their
    estimates skipped), which goes back into the heap keyed by its own (exposed, wire)
    bytes and is taken when it comes out first. Only each (stage, model)'s fewest
    micro-batches are walked up front: more micro-batches repeat the same collectives per
    micro-batch, so a group's least figures bound the next count's, which is walked only
    when the heap reaches it. ``groups``: ``(stage, model) -> micro-batch counts``, fewest
    first.
    """
    heap: list = []
    order = itertools.count()  # ties never reach the entries' reports

    def push(stage: int, m: int, accums: list[int], bound=(0, 0), found=None) -> None:
        # key: least exposed, least wire, fewer micro-batches, higher stage, narrower model
        heapq.heappush(heap, ((*bound, accums[0], -stage, m), next(order), stage, m, accums,
                              found))

    for (stage, m), accums in groups.items():
        push(stage, m, accums)
    fits: list[tuple[Candidate, PlanReport]] = []
    built = False
    while heap and len(fits) <= runners_up:
        key, _, stage, m, accums, found = heapq.heappop(heap)
        if found is not None:  # a group's fit, keyed by its own figures: the best left
            fits.append(found)
            continue
        if fits:  # the runners-up are fits already compiled: no compile for them
            continue
        group = variants(stage, accums[0], m)
        seen: list[tuple[int, int]] = []
        for cand in group:
            if search.ruled_out(cand) or (r := search.evaluate(cand)) is None:
                continue
            built = True
            seen.append((exposed_bytes(r), r.collectives["wire_bytes"]))
            if r.fits(search.budget_bytes):
                push(stage, m, accums, seen[-1], (cand, r))
                break
        search.say_ruled_out(group)
        if len(accums) > 1:
            push(stage, m, accums[1:], min(seen, default=key[:2]))
    if not built and not fits and not search.skipped:
        raise ConfigError("--budget: no configuration in the search space could be built")
    if not fits:
        raise search.nothing_fits(search.rows)
    return fits


def _micro_batches(config: Config, n_devices: int, sizes: list[int],
                   grad_accum: Sequence[int]) -> dict[int, list[int]]:
    """Per ``model`` axis size, the micro-batch counts that divide a device's rows."""
    # the rows' shards: every device but the model and context axes' (replica, data, expert)
    rows = lambda m: max(1, n_devices // (m * config.mesh.context))
    local = lambda m: config.data.batch_size // rows(m)
    accums = {m: [ga for ga in grad_accum if local(m) % ga == 0] for m in sizes}
    if not accums[sizes[0]]:
        m, context = sizes[0], config.mesh.context
        split = f"{n_devices} devices" + (f" / mesh.model {m}" if m > 1 else "") + \
            (f" / mesh.context {context}" if context > 1 else "")
        raise ConfigError(f"--budget: no micro-batch count in {tuple(grad_accum)} divides the "
                          f"local batch of {local(m)} (data.batch_size {config.data.batch_size} "
                          f"over {rows(m)} shards: {split})")
    return accums


def autotune(
    config: Config,
    *,
    budget_bytes: int,
    compile_report,
    n_devices: int,
    stages: Sequence[int] = (0, 1, 2, 3),
    offloads: Sequence[str] = OFFLOADS,
    prefetch: Sequence[int] = (2, 1, 0),
    grad_accum: Sequence[int] = (1, 2, 4),
    remat: Sequence[bool] = (False, True),
    activations: Sequence[str] = ACTIVATIONS,
    model: Sequence[int] | None = None,
    runners_up: int = 2,
    progress: Callable[[str], None] | None = None,
    estimate: Callable[[Config], Estimate] | None = None,
) -> TuneResult:
    """The fitting configuration that exposes the fewest collective bytes (those no compute
    overlaps; then the fewest in all), then the least offload.

    Args:
      config: the starting configuration (model, data, optimizer are kept).
      budget_bytes: device memory per device (the compiled peak must not exceed it).
      compile_report: ``compile_report(config) -> PlanReport``, raising ConfigError for a
        configuration that cannot be built (e.g. an offload a stage does not support).
      n_devices: devices in the mesh (``data`` x ``model``).
      stages, offloads, prefetch, grad_accum, remat: the search space.
      activations: stage 3's choices for the saved layer inputs (:data:`ACTIVATIONS`: on the
        device, split over ``model``, in host memory), most preferred first.
      model: ``model`` axis sizes to try (default: every divisor of ``n_devices`` up to 8;
        sizes the model cannot split, e.g. not dividing its heads, are skipped).
      runners_up: how many further fitting groups to report after the best (among those
        the search compiled before it).
      progress: called with one line before the search and after each candidate compiled
        (``[3/72] model 1 stage 3 ...: 12.3 MiB per device, fits (4.1 s)``; 72 is the size of
        the search space, which the search stops well short of).
      estimate: ``estimate(config) -> Estimate`` (:func:`zjax.planning._estimate.
        estimate_config`): with it, a candidate whose floor exceeds the budget, or whose
        estimate calibrated on the compiled candidates exceeds it by more than
        :data:`ESTIMATE_MARGIN`, is ruled out without a compile, and the leanest candidates
        are not compiled up front.
    """
    has_remat = any(f.name == "remat" for f in dataclasses.fields(config.model))
    sizes = [m for m in (model or range(1, min(8, n_devices) + 1)) if n_devices % m == 0]
    if not sizes:
        raise ConfigError(f"--budget: no model axis size in {tuple(model or ())} divides the "
                          f"{n_devices} devices")
    accums = _micro_batches(config, n_devices, sizes, grad_accum)
    remat = remat if has_remat else (None,)
    group_variants = functools.partial(variants, offloads=offloads, prefetch=prefetch,
                                       remat=remat, activations=activations)
    space = {c for m in sizes for stage in stages for ga in accums[m]
             for c in group_variants(stage, ga, m)}
    search = _Search(config, compile_report, budget_bytes, len(space), progress, estimate)
    if progress is not None:
        progress(f"searching {len(space)} candidates for {_size(budget_bytes)} per device, "
                 "least exposed communication first (each one tried is compiled)")
    # One leanest candidate per model axis size: a wider model axis splits the weights further
    # but raises each device's share of the batch (fewer data replicas), so which is leanest
    # depends on the model.
    top = max(stages)
    # with estimates, the walk itself rules out what cannot fit: no compile up front
    _check_leanest(search, [] if estimate is not None else [[
        Candidate(top, max(accums[m]), off if top else "none",
                  min(prefetch) if top == 3 else None,
                  (True if True in remat else None) if top < 3 else None, m,
                  [a for a in activations if a != "partition" or m > 1][-1]
                  if top == 3 else "device")
        for off in reversed(offloads)] for m in sizes if accums[m]])
    fits = _best_first(search, {(stage, m): accums[m] for m in sizes for stage in stages},
                       group_variants, runners_up)
    best_cand, best = fits[0]
    rest = sorted((cr for cr in search.rows if not cr[1].fits(budget_bytes)),
                  key=lambda cr: cr[1].per_device["total_bytes"])
    notes = () if estimate is None else (
        f"compiled {len(search.totals)} of {len(space)} candidates; {len(search.skipped)} ruled "
        "out by their estimates without a compile",)
    return TuneResult(best_cand.apply(config), best, fits + rest, budget_bytes, notes)
