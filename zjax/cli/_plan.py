"""``zjax plan``: a config's compiled step (``--target``, ``--devices``), the autotuner
(``--budget``, ``--write``) and the longest sequence that fits (``--longest-seq``). Separate
from :mod:`zjax.cli` to keep it small.

One rule for the exit code (:data:`EXIT_CODES`): what does not fit exits 2, whether the
compiler refuses the program (libtpu) or the compiled figures exceed the memory (every
other target), with offload or without."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from zjax.errors import ConfigError

__all__ = ["EXIT_CODES", "run_plan"]

# what a sequence that does not fit can change (the config's other settings stay as given)
FIT_ADVICE_SHORT = ("use more devices (mesh.context splits each sequence), offload "
                    "(zero.offload_*, zero.offload_activations) or a larger budget")

EXIT_CODES = (
    "exit codes: 0 the plan was made (and, with --target, the step fits the device memory); "
    "2 bad input, or what was asked does not fit: a --target's step over its device memory "
    "(the compiler refused it, or its compiled peak exceeds that memory: then the report is "
    "printed first), --budget with no configuration that fits, --longest-seq with no length that "
    "fits. The same with offload or without: device memory is judged, host memory (offloaded "
    "state and activations) is reported but not judged, a target naming no host memory size.")


def _progress(line: str) -> None:
    print(f"zjax plan: {line}", file=sys.stderr, flush=True)


def _check(args) -> None:
    """Flag combinations refused before anything compiles."""
    if args.write and Path(args.write).exists():
        raise ConfigError(f"--write: {args.write!r} already exists; zjax does not replace it")
    if args.base_dtypes is not None and (not args.budget or args.longest_seq):
        raise ConfigError("--base-dtypes: needs --budget without --longest-seq (the search "
                          "chooses among them)")
    if args.write and (not args.budget or args.longest_seq):
        raise ConfigError("--write: needs --budget without --longest-seq (it saves the "
                          "configuration the search chose)")
    if args.budget == "device" and not args.target:
        raise ConfigError("--budget: 'device' takes the memory of a --target; give a size "
                          "(e.g. 80GiB) or a --target")
    if args.longest_seq and not (args.budget or args.target):
        raise ConfigError("--longest-seq: needs a --budget or a --target (whose device "
                          "memory is the budget)")


def _check_fits(report, target: str | None) -> None:
    """A ``--target`` plan whose compiled peak exceeds the device memory is an error (exit 2),
    as libtpu's refusal of an oversized program is (:func:`zjax.planning.compile_report`)."""
    from zjax.planning import FIT_ADVICE
    from zjax.planning import format_bytes as _size

    if report.fits_device is False:
        d = report.per_device
        raise ConfigError(
            f"--target {target}: does not fit: the step needs {_size(d['total_bytes'])} per "
            f"device, over the {_size(d['capacity_bytes'])} of device memory; "
            f"{FIT_ADVICE}")
    rollout = report.rollout
    if rollout and rollout["fits_device"] is False:
        raise ConfigError(
            f"--target {target}: does not fit: the rollout phase needs "
            f"{_size(rollout['total_bytes'])} per device (the state, the model gathered in "
            f"zero.gather_dtype and the cache of {rollout['rows']} completions), over the "
            f"{_size(report.per_device['capacity_bytes'])} of device memory; fewer completions "
            "at once (data.batch_size, rl.steps_per_generation), more devices or a shorter "
            "rl.max_new_tokens")


def run_plan(args, path: str | None, overrides: list[str],
             setup_devices: Callable[[int | None], None]) -> int:
    """Run ``zjax plan`` for parsed ``args`` on the config at ``path`` with ``overrides``;
    ``setup_devices(n)`` simulates the devices once the input is known to be good.

    Returns 0; raises ConfigError (exit 2) for bad input and for what does not fit
    (:data:`EXIT_CODES`), after printing what was compiled."""
    from zjax.config import load_config

    config = load_config(path, overrides)
    _check(args)
    setup_devices(None if args.target else args.devices)
    budget = None if args.budget == "device" else args.budget
    if args.longest_seq:
        return _longest(args, config, budget)
    if not args.budget:
        from zjax.planning import plan

        report = plan(config, devices=args.devices, target=args.target, hosts=args.hosts)
        print(json.dumps(report.to_json()) if args.json else report.table(), flush=True)
        _check_fits(report, args.target)
        return 0
    return _tune(args, config, budget)


def _longest(args, config, budget) -> int:
    """``--longest-seq``: the table (or JSON), then exit 2 if not even the shortest fits."""
    from zjax.planning import format_bytes as _size
    from zjax.planning import longest_sequence

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
    sys.stdout.flush()
    if not result.seq_len:
        shortest = min((t[0] for t in result.tried), default=args.seq_step)
        raise ConfigError(f"--longest-seq: no length tried fits the budget of "
                          f"{_size(result.budget_bytes)} per device (not even {shortest:,} "
                          f"tokens); {FIT_ADVICE_SHORT}")
    return 0


def _tune(args, config, budget) -> int:
    """``--budget``: the search's table and its best plan (``--write``: saved); the search
    itself raises ConfigError when nothing fits."""
    import yaml

    from zjax.planning import autotune

    dtypes = None if args.base_dtypes is None else \
        [d.strip() for d in args.base_dtypes.split(",") if d.strip()]
    result = autotune(config, budget=budget, devices=args.devices, target=args.target,
                      progress=_progress, **({} if dtypes is None else {"base_dtypes": dtypes}))
    if args.json:
        print(json.dumps({"budget_bytes": result.budget_bytes, "best": result.report.to_json(),
                          "config": result.config.to_dict(), "notes": list(result.notes),
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
