"""``zjax.plan``: compile a config's train step ahead of time and report what it needs.

Nothing is allocated: the step is lowered from ``ShapeDtypeStruct``s. For more devices than
this process has, the plan runs in a subprocess that simulates them on the CPU
(``zjax plan --devices N --json``), since a process's device count is fixed when JAX starts.
With ``target`` (``h100:8``, ``v5p:2x2x2``; :mod:`zjax.runtime.targets`) the step is compiled
by that accelerator's own compiler for its compile-only devices, in this process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import yaml

from zjax.config import Config
from zjax.errors import ConfigError, DoesNotFitError, did_you_mean, first_line
from zjax.planning._activations import estimate
from zjax.planning._estimate import estimate_config
from zjax.planning._longest import LongestResult
from zjax.planning._longest import longest_sequence as _longest
from zjax.planning._report import PlanReport, report
from zjax.planning._rollout import rollout_figures
from zjax.planning._search import TuneResult, parse_bytes
from zjax.planning._search import autotune as _autotune
from zjax.runtime import compile_for_figures
from zjax.runtime.targets import Target, target
from zjax.task import abstract_batch, build_step, config_keys, flops_shape
from zjax.task.loop import resolve_loop

__all__ = ["autotune", "compile_report", "longest_sequence", "plan", "run_cli_json"]


# what a step that does not fit can change (the compiler's refusal and `zjax plan --target`'s
# own check of the compiled peak say the same)
FIT_ADVICE = ("use more devices, a smaller data.batch_size or data.seq_len, gradient "
              "accumulation (train.grad_accum) or offload (zero.offload_*)")


def compile_report(config: Config, devices: list, *, target: Target | None = None,
                   hosts: int | None = None) -> PlanReport:
    """Build, lower and compile ``config``'s step on ``devices``; report its figures.

    ``target``: the compile-only target the devices belong to (its name and capacity go in
    the report). ``hosts``: simulated hosts for the intra/inter-host split.
    """
    loop = resolve_loop(config.loop)
    with config_keys():
        zstep = build_step(config, devices, loop=loop)
        batch = abstract_batch(config, loop=loop)
        lowered = zstep.lower(batch)
    try:  # a target's compile is kept beside JAX's cache; XLA:CPU's is built unoptimised
        compiled = compile_for_figures(lowered, devices, compile_only=target is not None)
    except jax.errors.JaxRuntimeError as e:
        if not str(e).startswith("RESOURCE_EXHAUSTED"):
            raise
        # libtpu refuses a program over its HBM instead of reporting it: the answer to
        # "does it fit" is no, said as an error naming the target and the figures
        where = f"--target {target.name}" if target else "the step"
        raise DoesNotFitError(
            f"{where}: does not fit: "
            f"{first_line(e).removeprefix('RESOURCE_EXHAUSTED: ').rstrip('.')}; "
            f"{FIT_ADVICE}", temp_bytes=_refused_temp(str(e))) from None
    plan_ = zstep.plan
    activations = estimate(config.model, config.data, config.train, config.zero,
                           n_batch=plan_.n_batch, n_model=plan_.n_model,
                           n_context=plan_.n_context, act_bytes=plan_.zero.gather.itemsize,
                           platform=plan_.mesh.devices.flat[0].platform)
    out = report(zstep, compiled, grad_accum=config.train.grad_accum,
                 remat=getattr(config.model, "remat", None), target=target,
                 hosts=hosts, activations=activations, **flops_shape(config))
    if not config.rl.enabled:
        return out
    return dataclasses.replace(out, rollout=rollout_figures(
        zstep, config.rl, config.data, devices, compile_only=target is not None,
        capacity=target.capacity_bytes if target else None))


def _refused_temp(message: str) -> int | None:
    """The temporaries libtpu's refusal names ("the total memory required for HLO
    temporaries (193.53G) exceeds available HBM (95.74G)"), in bytes; None if it names none."""
    m = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    return round(float(m.group(1)) * scale[m.group(2)]) if m else None


def _target_devices(name: str, devices: int | None) -> tuple[Target, list]:
    t = target(name)
    if devices is not None and devices != len(t.devices):
        raise ConfigError(f"--devices: {devices} conflicts with --target {name} "
                          f"({len(t.devices)} devices); give one of them")
    return t, list(t.devices)


def plan(config: Config, *, devices: int | None = None, target: str | None = None,
         hosts: int | None = None) -> PlanReport:
    """Exact per-device memory and communication of ``config``'s train step.

    Args:
      config: a resolved :class:`zjax.Config`.
      devices: devices in the mesh (default: all of this process's; ``mesh.data: -1`` takes
        what the other axes leave). More than this process has are simulated in a subprocess.
      target: compile for an accelerator instead (:func:`zjax.runtime.targets.target` names:
        ``h100:8``, ``h200:8``, ``h100:2x8``, ``v5p:2x2x2``, ...): compile-only, in this process.
      hosts: split collective bytes into intra- and inter-host as if the devices were on this
        many hosts (contiguous blocks of the mesh, ``replica`` outermost); by default the
        devices' processes decide (a target's hosts, a multi-process job).

    Returns:
      A :class:`PlanReport` (``.table()`` to print, ``.to_json()`` for scripts).
    """
    if devices is not None and devices < 1:
        raise ConfigError(f"--devices: must be >= 1, got {devices}")
    if target is not None:
        t, devs = _target_devices(target, devices)
        return compile_report(config, devs, target=t, hosts=hosts)
    if devices is not None and devices > jax.device_count():
        extra = ["--hosts", str(hosts)] if hosts else []
        return PlanReport.from_json(run_cli_json(config, ["--devices", str(devices), *extra]))
    return compile_report(config, jax.devices()[:devices] if devices else jax.devices(),
                          hosts=hosts)


def run_cli_json(config: Config, args: list[str]) -> dict:
    """Run ``zjax plan CONFIG ARGS --json`` in a fresh CPU process; its JSON output."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["JAX_PLATFORMS"] = "cpu"
        r = subprocess.run([sys.executable, "-m", "zjax", "plan", str(path), *args, "--json"],
                           capture_output=True, text=True, env=env)
    if r.returncode == 2:
        raise ConfigError(r.stderr.strip().removeprefix("zjax: error: "))
    if r.returncode != 0:
        raise RuntimeError(f"zjax plan subprocess failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def autotune(config: Config, *, budget: int | str | None = None, devices: int | None = None,
             target: str | None = None, progress: Callable[[str], None] | None = None,
             base_dtypes: Sequence[str] | None = None, **space) -> TuneResult:
    """The fitting configuration that exposes the fewest collective bytes (those no compute
    overlaps; then the fewest in all), then the least offload.

    Args:
      config: the starting configuration.
      budget: device memory per device, in bytes or as text (``"80GiB"``); with a
        ``target``, its device memory by default.
      devices: devices in the mesh, at most this process's (the CLI ``zjax plan
        --budget B --devices N`` simulates more).
      target: search against an accelerator's compiler (see :func:`plan`).
      progress: called with a line per candidate compiled (``zjax plan --budget`` prints
        them to stderr); see :func:`zjax.planning._search.autotune`.
      base_dtypes: the ``lora.base_dtype`` values the search may choose (a LoRA config);
        the most precise that fits is taken (``bfloat16``, then ``int8``, then ``nf4``).
        None: the config's own, never changed.
      **space: narrows the search (``stages``, ``offloads``, ``prefetch``, ``grad_accum``,
        ``remat``; see :func:`zjax.planning._search.autotune`).

    Raises:
      ConfigError: nothing fits (with every allowed base dtype); bad ``base_dtypes``.
    """
    devs, compile_, budget_bytes = _budgeted(budget, devices, target)
    search = functools.partial(_autotune, budget_bytes=budget_bytes, n_devices=len(devs),
                               compile_report=compile_, progress=progress,
                               estimate=functools.partial(estimate_config, devices=devs),
                               **space)
    if base_dtypes is None:
        return search(config)
    refused = []
    for dtype in _base_dtypes(config, base_dtypes):
        try:
            result = search(dataclasses.replace(
                config, lora=dataclasses.replace(config.lora, base_dtype=dtype)))
        except ConfigError as e:
            if not str(e).startswith("--budget:"):  # not a budget's "nothing fits"
                raise
            refused.append(f"lora.base_dtype {dtype}: {str(e).removeprefix('--budget: ')}")
            continue
        return dataclasses.replace(result, notes=(*refused, f"lora.base_dtype: {dtype}",
                                                  *result.notes))
    raise ConfigError("--budget: no allowed lora.base_dtype fits: " + "; ".join(refused))


# the base dtypes from the most precise to the smallest: the order --base-dtypes tries them
_PRECISION = ("bfloat16", "int8", "nf4")


def _base_dtypes(config: Config, allowed: Sequence[str]) -> list[str]:
    """The allowed base dtypes, most precise first; refused without adapters."""
    if not config.lora.enabled:
        raise ConfigError("--base-dtypes: the config trains no adapters (lora.rank is 0): "
                          "there is no frozen base to store in another dtype")
    for dtype in allowed:
        if dtype not in _PRECISION:
            raise ConfigError(f"--base-dtypes: {dtype!r} is not a lora.base_dtype"
                              f"{did_you_mean(dtype, _PRECISION)}; choose among "
                              f"{', '.join(_PRECISION)}")
    if not allowed:
        raise ConfigError(f"--base-dtypes: empty; give some of {', '.join(_PRECISION)}")
    return [d for d in _PRECISION if d in allowed]


def _budgeted(budget: int | str | None, devices: int | None,
              target: str | None) -> tuple[list, Callable[[Config], PlanReport], int]:
    """The devices, their ``compile_report`` and the budget in bytes of a search: a target's
    devices and memory (by default), or this process's first ``devices`` and ``budget``."""
    if target is not None:
        t, devs = _target_devices(target, devices)
        compile_ = functools.partial(compile_report, devices=devs, target=t)
        budget = t.capacity_bytes if budget is None else budget
    else:
        if budget is None:
            raise ConfigError("--budget: needed unless --target gives the device memory")
        n = devices or jax.device_count()
        if n > jax.device_count():
            raise ConfigError(f"--devices: {n} exceeds this process's {jax.device_count()} "
                              f"devices; run `zjax plan CONFIG --budget B --devices {n}`")
        devs = jax.devices()[:n]
        compile_ = functools.partial(compile_report, devices=devs)
    return devs, compile_, budget if isinstance(budget, int) else parse_bytes(budget)


def longest_sequence(config: Config, *, budget: int | str | None = None,
                     devices: int | None = None, target: str | None = None, step: int = 1024,
                     progress: Callable[[str], None] | None = None) -> LongestResult:
    """The longest sequence ``config`` trains on, one per data-parallel rank, within a budget.

    Args:
      config: the configuration (its attention, offload and mesh settings are kept; its
        batch becomes one sequence per ``data`` rank, without micro-batches).
      budget: device memory per device, in bytes or as text; a target's memory by default.
      devices, target: as for :func:`plan` (devices at most this process's).
      step: the lengths tried are multiples of it.
      progress: called with a line per length compiled.

    Returns:
      A :class:`zjax.planning.LongestResult` (``.table()``; ``.report``: the plan there).
    """
    devs, compile_, budget_bytes = _budgeted(budget, devices, target)
    n = len(devs)
    model = config.mesh.model if config.mesh.model > 0 else (
        n // config.mesh.data if config.mesh.data > 0 else n)  # model -1: what data leaves
    # one sequence per data rank: each is split over mesh.context devices
    return _longest(config, compile_report=compile_, budget_bytes=budget_bytes,
                    sequences=max(1, n // (model * config.mesh.context)), step=step,
                    progress=progress)
