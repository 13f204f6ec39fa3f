"""``zjax.train(loop, config)``: the training loop around the ZeRO step.

It builds the mesh, the loop's model and the step, runs the compiled step over the loop's data,
evaluates on the held-out split, and records metrics (``metrics.jsonl``, TensorBoard) in the run
directory. Only process 0 prints and writes; every process logs warnings and errors.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zjax.checkpoint import Checkpointer, tree_digests
from zjax.config import Config, as_config
from zjax.errors import CheckpointError, ConfigError
from zjax.partition import frozen_part, nbytes
from zjax.planning import PlanReport, compiled_memory, report
from zjax.runtime.distributed import detect, initialize
from zjax.runtime.mesh import process_batch_slice
from zjax.step import TrainState, ZeroStep
from zjax.step.optim import make_schedule
from zjax.task import build_step, config_keys, flops_shape
from zjax.task.loop import Loop, resolve_loop
from zjax.training._grpo import RolloutMetrics, rollout_data
from zjax.training._hooks import Hook, run_hooks, training_steps
from zjax.training._initial import check_base, initial_frozen, initial_state
from zjax.training._metrics import MetricsWriter
from zjax.training._nonfinite import FiniteWatch
from zjax.training._preempt import PreemptionGuard
from zjax.training._reference import StartState, check_pairs, precomputed_reference
from zjax.training._rundir import RunDir
from zjax.training._train_hooks import Checkpoints, Evaluation, MetricsLog, Progress, preemption

__all__ = ["TrainResult", "train"]

log = logging.getLogger("zjax")


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
      state: the final (sharded) train state.
      history: one dict per logged step (the rows of ``metrics.jsonl``).
      step: the compiled-on-demand step, with its plan.
    """

    state: TrainState
    history: list[dict]
    step: ZeroStep


def _eval_hooks(zstep: ZeroStep, eval_data, put: Callable, train, log: MetricsLog) -> list:
    """Every ``train.eval_every`` steps, the held-out loss (none without eval batches)."""
    if eval_data is None:
        return []
    evaluation = Evaluation(zstep.evaluate_metrics, (put(b) for b in eval_data),
                            n_batches=train.eval_batches, log=log)
    return [Hook(evaluation, every=train.eval_every)]


def _iterator_state(it) -> Any:
    return it.get_state() if it is not None and hasattr(it, "get_state") else None


def train(loop: Loop | str | None, config: Config | Mapping[str, Any] | str | os.PathLike, *,
          run_dir: str | os.PathLike | None = None) -> TrainResult:
    """Train ``loop`` as ``config`` says; resume from ``run_dir``'s latest checkpoint.

    With a ``run_dir`` (locked for the run: a second trainer on it is refused), checkpoints are
    written every ``checkpoint.every`` steps, at the last step, and on SIGTERM / SIGINT: then
    every process stops at the same step, saves it, and
    :class:`~zjax.training._preempt.Preempted` is raised once the checkpoint is committed. A
    non-finite step is never saved
    (``train.on_nonfinite``). Starting again with the same ``run_dir`` resumes bit for bit.

    Args:
      loop: a :class:`~zjax.task.loop.Loop`, a loop name (``"lm"``, ``"pkg.mod:Name"``), or None
        for the config's own ``loop``.
      config: a :class:`~zjax.config.Config`, a dict of sections, or a YAML / gin file.
      run_dir: where the resolved config, ``metrics.jsonl``, TensorBoard events and
        checkpoints go (nothing is written when None).

    Returns:
      A :class:`TrainResult` with the final state and the metric history.

    Raises:
      ConfigError: bad config or run directory (in use, or a run with nothing to resume).
      CheckpointError: the run's checkpoint holds another model's or optimizer's state.
      NonFiniteError: a step was not finite (``train.on_nonfinite``).
      Preempted: stopped by a signal after saving a checkpoint.
    """
    model_config = None if loop is None or isinstance(loop, str) else getattr(
        loop, "model_config", None)
    config = as_config(config, model_config=model_config)
    if loop is None or isinstance(loop, str):
        loop = resolve_loop(loop or config.loop)
    check_pairs(config)  # before any data is read
    if hasattr(loop, "check"):
        loop.check(config.model, config.data)
    # before anything touches a device: join the multi-process job the environment describes
    initialize(config.mesh.distributed, detect(), timeout_s=config.mesh.init_timeout_s)
    lead = jax.process_index() == 0
    run = _lock_run_dir(run_dir, lead)
    try:
        return _train(loop, config, run_dir, run, lead)
    finally:
        if run is not None:
            run.close()


def _lock_run_dir(run_dir, lead: bool) -> RunDir | None:
    """Process 0 locks the run directory; with several processes all learn whether it could."""
    run, error = None, None
    if run_dir is not None and lead:
        try:
            run = RunDir(run_dir)
        except ConfigError as e:
            error = e
    if run_dir is not None and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            raise ConfigError(f"--run-dir: process 0 could not take {str(run_dir)!r} (its "
                              "error says why)")
    if error is not None:
        raise error
    return run


def _train(loop: Loop, config: Config, run_dir, run: RunDir | None, lead: bool) -> TrainResult:
    info = log.info if lead else (lambda *args: None)  # warnings and errors: every process
    steps, opt = config.train.steps, config.optimizer
    if opt.warmup_steps >= steps:  # accepted, as Hugging Face's schedules and DeepSpeed's do
        info("optimizer.warmup_steps %d >= train.steps %d: the warmup is cut by the run's end "
             "(the last step's rate %.3g, not optimizer.lr %g)", opt.warmup_steps, steps,
             opt.lr * (steps - 1) / opt.warmup_steps, opt.lr)
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", config.checkpoint) if run_dir else None
    try:
        if ckpt is not None and ckpt.steps() and ckpt.steps()[-1] >= steps:
            raise ConfigError(  # said before compiling anything
                f"train.steps: the run in {str(run_dir)!r} is already at step "
                f"{ckpt.steps()[-1]}; set train.steps above it to train further")
        with config_keys():  # the step's errors name the config's keys
            return _train_steps(loop, config, ckpt, run, info)
    finally:
        if ckpt is not None:
            ckpt.close()


def _train_steps(loop: Loop, config: Config, ckpt: Checkpointer | None, run: RunDir | None,
                 info) -> TrainResult:
    zstep = build_step(config, loop=loop)
    try:
        return _run_steps(zstep, loop, config, ckpt, run, info)
    finally:
        zstep.close()  # NVMe swap files are a working area: removed, never reused


def _run_steps(zstep: ZeroStep, loop: Loop, config: Config, ckpt: Checkpointer | None,
               run: RunDir | None, info) -> TrainResult:
    # the initial state, made once: by the precompute pass if it needs it, then the start
    initial = StartState(lambda: initial_state(zstep, config, info))
    current = {}  # the state a GRPO rollout samples from: the one the next step takes
    train_data, eval_data, put, keep = _data(
        loop, config, zstep, run=run, initial=initial, info=info,
        state_of=lambda: current["state"],
        shared=None if ckpt is None else ckpt.directory.parent)
    start, state, meta, resumed = _start(zstep, config, ckpt, train_data, eval_data, initial,
                                         info)
    current["state"] = state
    base = _base_meta(state, meta, config, resumed=resumed)
    first = put(next(train_data))
    compiled, memory, planned = _compile(zstep, config, first, info)
    if run is not None:  # every check has passed: only now is the run directory changed
        run.truncate_metrics(start)  # rows after the resumed step (all, starting afresh)
        run.write_config(config.to_dict())
        run.write_plan(planned.to_json())
        keep(run.path)  # a precomputed reference, for a resume
    watch = _finite_watch(config, meta)

    def save(step: int, state: TrainState) -> None:
        data_state = {"train": _iterator_state(train_data), "eval": _iterator_state(eval_data)}
        ckpt.save(step, state, zstep, data_state=data_state,
                  meta={"step": step, "config": config.to_dict(), **base,
                        "skipped": {"total": watch.skipped, "in_a_row": watch.in_a_row}})

    steps, train = config.train.steps, config.train
    checkpoints = None if ckpt is None else Checkpoints(
        ckpt, save, watch=watch, saved=start if resumed else None)
    batches = itertools.chain([first], (put(b) for b in train_data))
    with (MetricsWriter(run.path if run else None,
                        tensorboard=config.logging.tensorboard) as writer,
          Progress(steps, start=start, enabled=config.logging.progress
                   and jax.process_index() == 0) as progress,
          PreemptionGuard() as guard):
        log = MetricsLog(writer, schedule=make_schedule(config.optimizer, total_steps=steps),
                         tokens_per_step=config.data.batch_size * config.data.seq_len,
                         memory=memory, watch=watch, info=info, flops=planned.flops,
                         n_devices=planned.n_devices)
        hooks = [Hook(lambda s: current.update(state=s.state)), Hook(log.count),
                 Hook(lambda s: (watch.add(s.step, s.metrics), watch.poll()))]
        if config.rl.enabled:
            hooks.append(Hook(RolloutMetrics(train_data, every=train.log_every)))
        if checkpoints is not None:
            hooks.append(Hook(checkpoints, every=config.checkpoint.every))
        hooks.append(Hook(log.metrics, every=train.log_every))
        hooks += _eval_hooks(zstep, eval_data, put, train, log)
        hooks += [Hook(log.write), Hook(progress.update), Hook(preemption(guard, checkpoints))]
        for s in training_steps(compiled, state, batches, start=start, steps=steps):
            run_hooks(hooks, s)
            state = s.state
        watch.poll(wait=True)
        if checkpoints is not None:  # under the guard: a signal now cannot cut the last commit
            checkpoints.committed()
    return TrainResult(state, log.history, zstep)


def _base_meta(state: TrainState, meta: dict | None, config: Config, *, resumed: bool
               ) -> dict:
    """An adapters run's checkpoints name their base by its digests (computed once), checked
    on resume against the base read again; ``{}`` without frozen leaves."""
    if state.frozen is None:
        return {}
    digests = tree_digests(state.frozen)
    if resumed:
        check_base(digests, meta, config)
    return {"base_digests": digests}


def _compile(zstep: ZeroStep, config: Config, first: Any, info
             ) -> tuple[Any, dict, PlanReport]:
    """The step compiled for the first batch's shapes, its memory row and plan report."""
    compiled = zstep.lower(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                        first)).compile()
    return compiled, *_memory_row(zstep, compiled, config, info)


def _start(zstep: ZeroStep, config: Config, ckpt: Checkpointer | None, train_data, eval_data,
           initial: StartState, info) -> tuple[int, TrainState, dict, bool]:
    """``(start step, state, checkpoint meta, resumed)``: the newest checkpoint's state with
    the data iterators set where it left them, else the initial state."""
    # before compiling: a checkpoint of another model or optimizer is an error at once
    restored = ckpt.restore_latest(zstep, config=config.to_dict()) if ckpt else None
    if restored is None:
        return 0, initial.take(), {}, False
    initial.drop()
    start, state, data_state, meta = restored
    info("resuming from the checkpoint at step %d", start)
    if frozen_part(zstep.plan) is not None:  # checkpoints hold the trained leaves only
        state = state._replace(frozen=initial_frozen(zstep, config, info))
    for split, it in (("train", train_data), ("eval", eval_data)):
        if it is not None and data_state.get(split) is not None:
            _set_iterator(it, data_state[split], start, ckpt, split)
    return start, state, meta, True


def _finite_watch(config: Config, meta: dict | None) -> FiniteWatch:
    watch = FiniteWatch(config.train.on_nonfinite, max_skips=config.train.max_skips,
                        lockstep=jax.process_count() > 1)
    # the skip counts go on where the checkpoint left them
    skipped = (meta or {}).get("skipped") or {}
    watch.skipped, watch.in_a_row = skipped.get("total", 0), skipped.get("in_a_row", 0)
    return watch


def _data(loop: Loop, config: Config, zstep: ZeroStep, *, run: RunDir | None,
          initial: StartState, info, state_of, shared: Path | None):
    """``(train iterator, eval iterator or None, put, keep)``: ``put`` makes a global array of
    this process's rows. A preference run with ``reference: precompute`` computes its
    reference log-probs first (:mod:`zjax.training._reference`): ``keep(run_dir)`` writes
    them there once the run's checks have passed (a no-op otherwise). A GRPO run's train
    batches are rolled out from ``state_of()`` (:mod:`zjax.training._grpo`), each process
    keeping its pending batches in the run directory ``shared`` (every process's path to it,
    where ``run`` is process 0's lock)."""
    # processes that share data rows (a model axis across processes) load the same slice
    index, count = process_batch_slice(zstep.plan.mesh)
    shard = dict(process_index=index, process_count=count, seed=config.train.seed)

    def put_one(local: Any) -> jax.Array:
        local = np.asarray(local)
        global_shape = (local.shape[0] * count, *local.shape[1:])
        zstep.check_batch(global_shape)
        return jax.make_array_from_process_local_data(zstep.batch_sharding, local, global_shape)

    def put(local: Any) -> Any:  # an array, or a dict of them (packed documents)
        return jax.tree.map(put_one, local) if isinstance(local, dict) else put_one(local)

    if config.rl.enabled:  # batches rolled out from the state, no held-out loss
        return rollout_data(loop, config, zstep, put=put, state_of=state_of,
                            run_dir=shared, process=(index, count),
                            info=info), None, put, lambda run_dir: None
    splits = ("train", "eval") if config.train.eval_every else ("train",)
    refs, keep = {split: {} for split in splits}, lambda run_dir: None
    if config.preference.source == "precompute" and config.preference.enabled:
        found, keep = precomputed_reference(
            zstep, {split: loop.preference_rows(config.data, split=split) for split in splits},
            config, start=initial.peek, put=put, process=(index, count),
            run_dir=run.path if run else None, info=info)
        refs = {split: {"ref_logps": found[split]} for split in splits}
    train_data = loop.data(config.data, split="train", **shard, **refs["train"])
    # None: nothing held out to evaluate on (the loop has warned); the run goes on without
    eval_data = loop.data(config.data, split="eval", **shard, **refs["eval"]) \
        if config.train.eval_every else None
    return train_data, eval_data, put, keep


def _memory_row(zstep: ZeroStep, compiled, config: Config, info) -> tuple[dict, PlanReport]:
    """The compiled step's memory, logged in every metrics row, and its plan report."""
    memory = {f"memory_{k}": v for k, v in compiled_memory(compiled).items()}
    memory["state_bytes"] = nbytes(zstep.abstract_state)
    planned = report(zstep, compiled, grad_accum=config.train.grad_accum,
                     remat=getattr(config.model, "remat", None), **flops_shape(config))
    info("%s", planned.table())
    # memory_analysis() does not tell host from device bytes on CPU: the plan counts by kind
    memory["state_host_bytes"] = planned.per_device["host_bytes"]
    memory["state_device_bytes"] = memory["state_bytes"] - memory["state_host_bytes"]
    memory["state_nvme_bytes"] = planned.per_device["nvme_bytes"]
    # predicted (the ZeRO paper's formula) beside what the compiled step holds
    memory["model_state_bytes"] = planned.per_device["model_state_bytes"]
    memory["predicted_model_state_bytes"] = planned.formula["model_state_bytes"]
    info("compiled step, per device: state %.2f MiB on device + %.2f MiB in host memory + "
         "%.2f MiB on NVMe, temp %.2f MiB, peak %.2f MiB", memory["state_device_bytes"] / 2**20,
         memory["state_host_bytes"] / 2**20, memory["state_nvme_bytes"] / 2**20,
         memory["memory_temp_bytes"] / 2**20, memory["memory_peak_bytes"] / 2**20)
    return memory, planned


def _set_iterator(it, state: Any, step: int, ckpt: Checkpointer, split: str) -> None:
    """Restore a data iterator; a state that does not fit the data config is refused."""
    try:
        it.set_state(state)
    except (CheckpointError, ConfigError):  # zjax's own words (the rollouts'): whole
        raise
    except Exception as e:  # the iterator's own error, worded for the user
        raise CheckpointError(
            f"the {split} data iterator's state in the checkpoint at step {step} in "
            f"{ckpt.directory} does not fit this run's data (data.*): {type(e).__name__}: "
            f"{str(e)[:200]}. That checkpoint was left as it is: use the data config the run "
            "was started with, or a new --run-dir") from None
