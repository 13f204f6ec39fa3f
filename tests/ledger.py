"""The suite's time ledger: every run ends with one short block, the run's wall time against
its budget and the test files whose seconds grew past the ledger's.

The ledger is ``tests/test_seconds.json`` (each test's seconds in a cold run, written by
``python tests/census.py --seconds REPORT.xml``; conftest also orders the files by it). A
file "grew" when its tests (set-up, call and tear-down, as the workers measured them) took
more than 20% and more than 30 s over the ledger's seconds for the same tests: the budget is
the whole suite's, and a feature's tests pay for themselves (docs/testing.md).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

__all__ = ["BUDGETS", "Ledger", "grown", "install"]

# wall-clock budgets on 2 cores (docs/testing.md): the whole suite cold and warm (its
# compiles read back from the cache), the quick loop cold
BUDGETS = {"full": "20 min cold, 10 min warm", "quick": "3 min cold"}
GROWTH = 0.20  # a file grew: more than 20% ...
GROWTH_SECONDS = 30.0  # ... and more than 30 s over the ledger


def grown(measured: dict[str, float], ledger: dict[str, float]) -> list[tuple[str, float, float]]:
    """``(file, seconds, ledger's seconds)`` of the files that took more than :data:`GROWTH`
    and :data:`GROWTH_SECONDS` over the ledger (a file the ledger lacks counts from 0), the
    largest growth first."""
    out = []
    for name, seconds in measured.items():
        before = ledger.get(name, 0.0)
        if seconds > before * (1 + GROWTH) and seconds - before > GROWTH_SECONDS:
            out.append((name, seconds, before))
    return sorted(out, key=lambda row: row[2] - row[1])


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


class Ledger:
    """Sums each test file's reported seconds (on the controller: the workers' reports) and
    writes the block at the end of the run."""

    def __init__(self, config: pytest.Config, table: Path, notes=()):
        self.config = config
        self.table = table
        self.notes = notes  # callables giving more lines for the block (or None)
        self.start = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.ran: set[str] = set()  # the tests reported (the controller collects nothing)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration
        self.ran.add(report.nodeid)

    def _kind(self) -> str | None:
        """``full`` or ``quick`` for the whole suite or the quick loop, else None."""
        args = [a for a in self.config.args if not a.startswith("-")]
        whole = all(Path(a).resolve() == self.table.parent for a in args)
        mark = (self.config.option.markexpr or "").replace("'", '"').strip()
        if not whole or self.config.option.keyword:
            return None
        return {"": "full", "not slow": "quick"}.get(mark)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput") or not self.seconds:
            return
        wall, kind = time.monotonic() - self.start, self._kind()
        ran = sum(self.seconds.values())
        budget = (f"budget {BUDGETS[kind]} on 2 cores ({kind} run)" if kind
                  else "a part of the suite: no budget")
        write = terminalreporter.write_line
        terminalreporter.write_sep("-", "suite time")
        write(f"wall {_minutes(wall)}; {budget}; {ran:.0f} s of tests in "
              f"{len(self.seconds)} files")
        for note in self.notes:
            if (line := note()) is not None:
                write(line)
        rows = grown(dict(self.seconds), self._ledger())
        for name, seconds, before in rows[:10]:
            write(f"grew: {name} {seconds:.0f} s (ledger {before:.0f} s, "
                  f"+{seconds - before:.0f} s)")
        if rows:
            write(f"({len(rows)} files grew past the ledger, tests/test_seconds.json; after a "
                  "whole cold run, python tests/census.py --seconds REPORT.xml updates it)")

    def _ledger(self) -> dict[str, float]:
        """The ledger's seconds per file, over the tests this run ran."""
        table = json.loads(self.table.read_text()) if self.table.is_file() else {}
        out: dict[str, float] = defaultdict(float)
        for node in self.ran:
            out[node.split("::")[0]] += table.get(node, 0.0)
        return dict(out)


def install(config: pytest.Config, *, notes=()) -> None:
    """Register the ledger (``pytest_configure``); on the controller only, where the run's
    reports all arrive. ``notes``: callables whose lines (None: none) the block adds."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(
            Ledger(config, Path(__file__).with_name("test_seconds.json"), notes), "zjax-ledger")
