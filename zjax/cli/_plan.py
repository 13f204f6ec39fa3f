"""``zjax plan``: a config's compiled step (``--target``, ``--devices``), the autotuner
(``--budget``, ``--write``) and the longest sequence that fits (``--longest-seq``). Separate
from :mod:`zjax.cli` to keep it small."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from zjax.errors import ConfigError

__all__ = ["run_plan"]


def _progress(line: str) -> None:
    print(f"zjax plan: {line}", file=sys.stderr, flush=True)


def _check(args) -> None:
    """Flag combinations refused before anything compiles."""
    if args.write and Path(args.write).exists():
        raise ConfigError(f"--write: {args.write!r} already exists; zjax does not replace it")
    if args.write and (not args.budget or args.longest_seq):
        raise ConfigError("--write: needs --budget without --longest-seq (it saves the "
                          "configuration the search chose)")
    if args.budget == "device" and not args.target:
        raise ConfigError("--budget: 'device' takes the memory of a --target; give a size "
                          "(e.g. 80GiB) or a --target")
    if args.longest_seq and not (args.budget or args.target):
        raise ConfigError("--longest-seq: needs a --budget or a --target (whose device "
                          "memory is the budget)")


def run_plan(args, path: str | None, overrides: list[str],
             setup_devices: Callable[[int | None], None]) -> int:
    """Run ``zjax plan`` for parsed ``args`` on the config at ``path`` with ``overrides``;
    ``setup_devices(n)`` simulates the devices once the input is known to be good."""
    import yaml

    from zjax.config import load_config

    config = load_config(path, overrides)
    _check(args)
    setup_devices(None if args.target else args.devices)
    from zjax.planning import autotune, longest_sequence, plan

    budget = None if args.budget == "device" else args.budget
    if args.longest_seq:
        result = longest_sequence(config, budget=budget, devices=args.devices,
                                  target=args.target, step=args.seq_step, progress=_progress)
        if args.json:
            print(json.dumps({"seq_len": result.seq_len, "budget_bytes": result.budget_bytes,
                              "tried": [list(t) for t in result.tried],
                              "report": result.report and result.report.to_json()}))
        else:
            print(result.table())
            if result.report is not None:
                print(result.report.table())
        return 0
    if not args.budget:
        report = plan(config, devices=args.devices, target=args.target, hosts=args.hosts)
        print(json.dumps(report.to_json()) if args.json else report.table())
        return 0
    result = autotune(config, budget=budget, devices=args.devices, target=args.target,
                      progress=_progress)
    if args.json:
        print(json.dumps({"budget_bytes": result.budget_bytes, "best": result.report.to_json(),
                          "config": result.config.to_dict(),
                          "rows": [{"candidate": vars(c), **r.to_json()}
                                   for c, r in result.rows]}))
    else:
        print(result.table())
        print(result.report.table())
    if args.write:
        Path(args.write).write_text(yaml.safe_dump(result.config.to_dict(), sort_keys=False))
        if not args.json:
            print(f"wrote {args.write}")
    return 0
