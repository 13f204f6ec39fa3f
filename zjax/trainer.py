"""``zjax.train(loop, config)``: the training loop around the ZeRO step.

It builds the mesh, the loop's model and the step, runs the compiled step over the loop's data,
evaluates on the held-out split, and records metrics (``metrics.jsonl``, TensorBoard) in the run
directory. Only process 0 prints and writes; every process logs warnings and errors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zjax._metrics import MetricsWriter
from zjax._nonfinite import FiniteWatch
from zjax._planning import report
from zjax._preempt import Preempted, PreemptionGuard
from zjax._rundir import RunDir
from zjax.checkpoint import Checkpointer
from zjax.config import Config, as_config
from zjax.distributed import detect, initialize
from zjax.errors import CheckpointError, ConfigError
from zjax.loop import Loop, resolve_loop
from zjax.mesh import make_mesh, process_batch_slice
from zjax.optim import make_optimizer, make_schedule
from zjax.partition.plan import bytes_per_device
from zjax.step import TrainState, ZeroStep, make_step

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


def _memory(compiled) -> dict[str, int]:
    mem = compiled.memory_analysis()
    return {
        "memory_argument_bytes": int(mem.argument_size_in_bytes),
        "memory_output_bytes": int(mem.output_size_in_bytes),
        "memory_temp_bytes": int(mem.temp_size_in_bytes),
        "memory_peak_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                 + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
    }


class _Progress:
    """A rich progress bar on a terminal (process 0 only); nothing elsewhere."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        console = Console()
        if not console.is_terminal:
            return
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]}"),
                            TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn(),
                            console=console)
        self.task = self.bar.add_task("train", total=total, loss="-", tps="-")
        self.bar.start()

    def update(self, step: int, row: dict | None) -> None:
        if self.bar is None:
            return
        fields = {}
        if row is not None:
            fields = {"loss": f"{row['loss']:.4f}", "tps": f"{row['tokens_per_s']:,.0f}"}
        self.bar.update(self.task, completed=step, **fields)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _iterator_state(it) -> Any:
    return it.get_state() if it is not None and hasattr(it, "get_state") else None


def train(loop: Loop | str | None, config: Config | Mapping[str, Any] | str | os.PathLike, *,
          run_dir: str | os.PathLike | None = None) -> TrainResult:
    """Train ``loop`` as ``config`` says; resume from ``run_dir``'s latest checkpoint.

    With a ``run_dir`` (locked for the run: a second trainer on it is refused), checkpoints are
    written every ``checkpoint.every`` steps, at the last step, and on SIGTERM / SIGINT: then
    every process stops at the same step, saves it, and :class:`~zjax._preempt.Preempted` is
    raised once the checkpoint is committed. A non-finite step is never saved
    (``train.on_nonfinite``). Starting again with the same ``run_dir`` resumes bit for bit.

    Args:
      loop: a :class:`~zjax.loop.Loop`, a loop name (``"lm"``, ``"pkg.mod:Name"``), or None
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
    steps = config.train.steps
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", config.checkpoint) if run_dir else None
    try:
        if ckpt is not None and ckpt.steps() and ckpt.steps()[-1] >= steps:
            raise ConfigError(  # said before compiling anything
                f"train.steps: the run in {str(run_dir)!r} is already at step "
                f"{ckpt.steps()[-1]}; set train.steps above it to train further")
        return _train_steps(loop, config, ckpt, run, info)
    finally:
        if ckpt is not None:
            ckpt.close()


def _train_steps(loop: Loop, config: Config, ckpt: Checkpointer | None, run: RunDir | None,
                 info) -> TrainResult:
    mesh = make_mesh(config.mesh)
    steps = config.train.steps
    tx = make_optimizer(config.optimizer, total_steps=steps)
    schedule = make_schedule(config.optimizer, total_steps=steps)
    zstep = make_step(loop.trainable(config.model), tx, zero=config.zero, mesh=mesh,
                      micro_batches=config.train.grad_accum,
                      skip_nonfinite=config.train.on_nonfinite == "skip")

    # processes that share data rows (a model axis across processes) load the same slice
    index, count = process_batch_slice(mesh)
    shard = dict(process_index=index, process_count=count)
    train_data = loop.data(config.data, split="train", seed=config.train.seed, **shard)
    eval_data = None
    if config.train.eval_every:
        eval_data = loop.data(config.data, split="eval", seed=config.train.seed, **shard)

    def put(local: Any) -> jax.Array:
        local = np.asarray(local)
        global_shape = (local.shape[0] * count, *local.shape[1:])
        zstep.check_batch(global_shape)
        return jax.make_array_from_process_local_data(zstep.batch_sharding, local, global_shape)

    # before compiling: a checkpoint of another model or optimizer is an error at once
    restored = ckpt.restore_latest(zstep, config=config.to_dict()) if ckpt else None
    start = 0
    if restored is None:
        state = zstep.init(jax.random.key(config.train.seed))
    else:
        start, state, data_state, meta = restored
        info("resuming from the checkpoint at step %d", start)
        if data_state.get("train") is not None:
            _set_iterator(train_data, data_state["train"], start, ckpt, "train")
        if eval_data is not None and data_state.get("eval") is not None:
            _set_iterator(eval_data, data_state["eval"], start, ckpt, "eval")
    first = put(next(train_data))
    compiled = zstep.lower(jax.ShapeDtypeStruct(first.shape, first.dtype)).compile()
    memory = _memory_row(zstep, compiled, config, info)
    if run is not None:  # every check has passed: only now is the run directory changed
        run.truncate_metrics(start)  # rows after the resumed step (all, starting afresh)
        run.write_config(config.to_dict())

    def save(step: int) -> None:
        data_state = {"train": _iterator_state(train_data), "eval": _iterator_state(eval_data)}
        ckpt.save(step, state, zstep, data_state=data_state,
                  meta={"step": step, "config": config.to_dict(),
                        "skipped": {"total": watch.skipped, "in_a_row": watch.in_a_row}})

    writer = MetricsWriter(run.path if run else None, tensorboard=config.logging.tensorboard)
    progress = _Progress(steps, config.logging.progress and jax.process_index() == 0)
    progress.update(start, None)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    watch = FiniteWatch(config.train.on_nonfinite, max_skips=config.train.max_skips,
                        lockstep=jax.process_count() > 1)
    if restored is not None:  # the skip counts go on where the checkpoint left them
        skipped = (meta or {}).get("skipped") or {}
        watch.skipped, watch.in_a_row = skipped.get("total", 0), skipped.get("in_a_row", 0)
    history: list[dict] = []
    t0, done, saved = time.perf_counter(), 0, start if restored is not None else None
    batch = first
    with PreemptionGuard() as guard:
        try:
            for i in range(start, steps):
                if i > start:
                    batch = put(next(train_data))
                state, metrics = compiled(state, batch)
                done += 1
                step = i + 1
                watch.add(step, metrics)
                watch.poll()
                if ckpt is not None and ckpt.should_save(step, steps):
                    watch.poll(wait=True)  # never save a non-finite state
                    save(step)
                    saved = step
                if step % config.train.log_every == 0 or step == steps:
                    row = {k: float(v) for k, v in metrics.items()
                           if k not in ("count", "finite")}  # blocks
                    watch.poll(wait=True)
                    dt = time.perf_counter() - t0
                    row = {"step": step, **row, "lr": float(schedule(step - 1)),
                           "tokens_per_s": done * tokens_per_step / dt,
                           "step_time_s": dt / done}
                    if config.train.on_nonfinite == "skip":
                        row["skipped_steps"] = watch.skipped
                    evaluate = eval_data is not None and (
                        step % config.train.eval_every == 0 or step == steps)
                    if evaluate:
                        losses = [zstep.evaluate(state.params, put(next(eval_data)))
                                  for _ in range(config.train.eval_batches)]
                        row["eval_loss"] = float(np.mean([float(x) for x in losses]))
                    row.update(memory)
                    history.append(row)
                    writer.write(row)  # process 0 with a run directory; else a no-op
                    evals = f" | eval {row['eval_loss']:.4f}" if "eval_loss" in row else ""
                    info("step %5d | loss %.4f%s | %8.0f tok/s | %.3f s/step", step,
                         row["loss"], evals, row["tokens_per_s"], row["step_time_s"])
                    progress.update(step, row)
                    t0, done = time.perf_counter(), 0
                else:
                    progress.update(step, None)
                # every process asks at every step; the answer is the same everywhere
                if guard.reached(step) and step < steps:
                    if ckpt is not None and saved != step:
                        watch.poll(wait=True)
                        save(step)
                    if ckpt is not None:
                        ckpt.wait()
                        committed = ckpt.steps()
                        saved = committed[-1] if committed else None
                    raise Preempted(step, guard.signum, str(ckpt.directory) if ckpt else None,
                                    saved if ckpt is not None else None)
            watch.poll(wait=True)
            if ckpt is not None:  # under the guard: a signal now cannot cut the last commit
                ckpt.wait()
        finally:
            progress.close()
            writer.close()
    return TrainResult(state, history, zstep)


def _memory_row(zstep: ZeroStep, compiled, config: Config, info) -> dict:
    memory = _memory(compiled)
    memory["state_bytes"] = bytes_per_device(zstep.abstract_state, zstep.state_shardings)
    planned = report(zstep, compiled, grad_accum=config.train.grad_accum,
                     remat=getattr(config.model, "remat", None))
    info("%s", planned.table())
    # memory_analysis() does not tell host from device bytes on CPU: the plan counts by kind
    memory["state_host_bytes"] = planned.per_device["host_bytes"]
    memory["state_device_bytes"] = memory["state_bytes"] - memory["state_host_bytes"]
    # predicted (the ZeRO paper's formula) beside what the compiled step holds
    memory["model_state_bytes"] = planned.per_device["model_state_bytes"]
    memory["predicted_model_state_bytes"] = planned.formula["model_state_bytes"]
    info("compiled step, per device: state %.2f MiB on device + %.2f MiB in host memory, "
         "temp %.2f MiB, peak %.2f MiB", memory["state_device_bytes"] / 2**20,
         memory["state_host_bytes"] / 2**20, memory["memory_temp_bytes"] / 2**20,
         memory["memory_peak_bytes"] / 2**20)
    return memory


def _set_iterator(it, state: Any, step: int, ckpt: Checkpointer, split: str) -> None:
    """Restore a data iterator; a state that does not fit the data config is refused."""
    try:
        it.set_state(state)
    except Exception as e:  # the iterator's own error, worded for the user
        raise CheckpointError(
            f"the {split} data iterator's state in the checkpoint at step {step} in "
            f"{ckpt.directory} does not fit this run's data (data.*): {type(e).__name__}: "
            f"{str(e)[:200]}. That checkpoint was left as it is: use the data config the run "
            "was started with, or a new --run-dir") from None
