"""Planning: what a configuration's compiled step needs, read off the compiler's own output.

It imports the task (to build the step from a config), the step, partition, offload, nn,
the runtime (compile-only targets) and the config; the training run and the CLI import it.

Not to be confused with :class:`zjax.partition.ShardPlan`, the per-leaf *placement* decided
before anything compiles. This package compiles the step (ahead of time, from
``ShapeDtypeStruct``s; for a compile-only accelerator target too) and reports:

- :func:`plan` / :func:`compile_report` -> :class:`PlanReport`: per-device memory from
  ``memory_analysis()``, collective bytes and overlap from the scheduled HLO, the ZeRO paper's
  formula beside them (:func:`report`, :func:`formula`).
- :func:`autotune` -> :class:`TuneResult`: the fitting configuration with the least
  communication (:func:`search` is the search itself, given any ``compile_report``; with
  :func:`estimate_config`'s :class:`Estimate` it compiles only the candidates that may fit).
- :func:`longest_sequence` -> :class:`LongestResult`: the longest sequence per device that
  fits a budget.
- The HLO reader: :func:`collective_bytes`, :func:`collective_sites`,
  :func:`unordered_collectives`, and the text helpers :func:`axes_of`, :func:`group_size`.
"""

from zjax.planning._candidates import Candidate
from zjax.planning._estimate import Estimate, estimate_config
from zjax.planning._hlo import (
    CollectiveBytes,
    CollectiveSite,
    UnorderedPair,
    collective_bytes,
    collective_sites,
    unordered_collectives,
)
from zjax.planning._hlo_text import axes_of, group_size, link_of
from zjax.planning._longest import LongestResult
from zjax.planning._memory import compiled_memory, format_bytes, formula
from zjax.planning._plan import (
    FIT_ADVICE,
    autotune,
    compile_report,
    longest_sequence,
    plan,
    run_cli_json,
)
from zjax.planning._report import PlanReport, report
from zjax.planning._search import TuneResult, exposed_bytes, parse_bytes
from zjax.planning._search import autotune as search

__all__ = [
    "FIT_ADVICE",
    "Candidate",
    "CollectiveBytes",
    "CollectiveSite",
    "Estimate",
    "LongestResult",
    "PlanReport",
    "TuneResult",
    "UnorderedPair",
    "autotune",
    "axes_of",
    "collective_bytes",
    "collective_sites",
    "compile_report",
    "compiled_memory",
    "estimate_config",
    "exposed_bytes",
    "format_bytes",
    "formula",
    "group_size",
    "link_of",
    "longest_sequence",
    "parse_bytes",
    "plan",
    "report",
    "run_cli_json",
    "search",
    "unordered_collectives",
]
