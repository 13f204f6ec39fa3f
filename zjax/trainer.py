"""``zjax.train(loop, config)``: the training loop around the ZeRO step.

It builds the mesh, the loop's model and the step, runs the compiled step over the loop's data,
evaluates on the held-out split, and records metrics (``metrics.jsonl``, TensorBoard) in the run
directory. Only process 0 prints and writes; every process logs warnings and errors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from zjax._metrics import MetricsWriter, read_metrics
from zjax._planning import report
from zjax._preempt import Preempted, PreemptionGuard
from zjax.checkpoint import Checkpointer
from zjax.config import Config, load_config
from zjax.distributed import detect, initialize
from zjax.errors import ConfigError
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


def _prepare_run_dir(run_dir: str | os.PathLike | None, config: Config) -> Path | None:
    if run_dir is None:
        return None
    run_dir = Path(run_dir)
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any(
        p.name.isdigit() for p in (run_dir / "checkpoints").iterdir()
    )
    if (run_dir / "metrics.jsonl").exists() and not has_checkpoints:
        raise ConfigError(
            f"--run-dir: {str(run_dir)!r} already holds a run (metrics.jsonl) but no checkpoint "
            "to resume from; zjax does not overwrite it. Choose a new directory."
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    except OSError as e:
        raise ConfigError(f"--run-dir: cannot write to {str(run_dir)!r}: {e}") from None
    return run_dir


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


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from (they will be logged again)."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [r for r in read_metrics(run_dir) if r["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)


def _iterator_state(it) -> Any:
    return it.get_state() if it is not None and hasattr(it, "get_state") else None


def train(loop: Loop | str | None, config: Config | str | os.PathLike, *,
          run_dir: str | os.PathLike | None = None) -> TrainResult:
    """Train ``loop`` as ``config`` says; resume from ``run_dir``'s latest checkpoint.

    With a ``run_dir``, checkpoints are written every ``checkpoint.every`` steps, at the last
    step, and on SIGTERM / SIGINT (then :class:`~zjax._preempt.Preempted` is raised after the
    checkpoint is complete). Starting again with the same ``run_dir`` resumes bit for bit.

    Args:
      loop: a :class:`~zjax.loop.Loop`, a loop name (``"lm"``, ``"pkg.mod:Name"``), or None
        for the config's own ``loop``.
      config: a :class:`~zjax.config.Config` or a path to a YAML / gin file.
      run_dir: where the resolved config, ``metrics.jsonl`` and TensorBoard events go
        (nothing is written when None).

    Returns:
      A :class:`TrainResult` with the final state and the metric history.
    """
    if not isinstance(config, Config):
        config = load_config(config)
    if loop is None or isinstance(loop, str):
        loop = resolve_loop(loop or config.loop)
    if hasattr(loop, "check"):
        loop.check(config.model, config.data)
    # before anything touches a device: join the multi-process job the environment describes
    initialize(config.mesh.distributed, detect(), timeout_s=config.mesh.init_timeout_s)
    lead = jax.process_index() == 0
    info = log.info if lead else (lambda *args: None)  # warnings and errors: every process
    run_path = _prepare_run_dir(run_dir, config) if lead else None

    mesh = make_mesh(config.mesh)
    steps = config.train.steps
    tx = make_optimizer(config.optimizer, total_steps=steps)
    schedule = make_schedule(config.optimizer, total_steps=steps)
    zstep = make_step(loop.trainable(config.model), tx, zero=config.zero, mesh=mesh,
                      micro_batches=config.train.grad_accum)

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

    first = put(next(train_data))
    compiled = zstep.lower(jax.ShapeDtypeStruct(first.shape, first.dtype)).compile()
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

    ckpt = Checkpointer(Path(run_dir) / "checkpoints", config.checkpoint) if run_dir else None
    restored = ckpt.restore_latest(zstep) if ckpt is not None else None
    start = 0
    if restored is None:
        state = zstep.init(jax.random.key(config.train.seed))
    else:
        start, state, data_state, _ = restored
        info("resuming from the checkpoint at step %d", start)
        if start >= steps:
            ckpt.close()
            raise ConfigError(
                f"train.steps: the run in {str(run_dir)!r} is already at step {start}; set "
                f"train.steps above {start} to train further"
            )
        if data_state.get("train") is not None:
            train_data.set_state(data_state["train"])
            first = put(next(train_data))
        if eval_data is not None and data_state.get("eval") is not None:
            eval_data.set_state(data_state["eval"])
        if run_path is not None:
            _truncate_metrics(run_path, start)

    def save(step: int) -> None:
        data_state = {"train": _iterator_state(train_data), "eval": _iterator_state(eval_data)}
        ckpt.save(step, state, zstep, data_state=data_state,
                  meta={"step": step, "config": config.to_dict()})

    writer = MetricsWriter(run_path, tensorboard=config.logging.tensorboard)
    progress = _Progress(steps, config.logging.progress and lead)
    progress.update(start, None)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    history: list[dict] = []
    t0, done = time.perf_counter(), 0
    batch = first
    guard = PreemptionGuard()
    try:
        guard.__enter__()
        for i in range(start, steps):
            if i > start:
                batch = put(next(train_data))
            state, metrics = compiled(state, batch)
            done += 1
            step = i + 1
            if ckpt is not None and (ckpt.should_save(step, steps) or guard.signum):
                save(step)
            if step % config.train.log_every == 0 or step == steps:
                row = {k: float(v) for k, v in metrics.items() if k != "count"}  # blocks
                dt = time.perf_counter() - t0
                row = {"step": step, **row, "lr": float(schedule(step - 1)),
                       "tokens_per_s": done * tokens_per_step / dt, "step_time_s": dt / done}
                evaluate = step % config.train.eval_every == 0 or step == steps \
                    if eval_data is not None else False
                if evaluate:
                    losses = [zstep.evaluate(state.params, put(next(eval_data)))
                              for _ in range(config.train.eval_batches)]
                    row["eval_loss"] = float(np.mean([float(x) for x in losses]))
                row.update(memory)
                history.append(row)
                if lead:
                    writer.write(row)
                    evals = f" | eval {row['eval_loss']:.4f}" if "eval_loss" in row else ""
                    info("step %5d | loss %.4f%s | %8.0f tok/s | %.3f s/step", step,
                         row["loss"], evals, row["tokens_per_s"], row["step_time_s"])
                progress.update(step, row)
                t0, done = time.perf_counter(), 0
            else:
                progress.update(step, None)
            # after the step's metrics row, so a stop on a logged step does not lose it
            if guard.signum:
                if ckpt is not None:
                    ckpt.wait()
                raise Preempted(step, guard.signum, str(ckpt.directory) if ckpt else None)
    finally:
        guard.__exit__()
        progress.close()
        writer.close()
        if ckpt is not None:
            ckpt.close()
    return TrainResult(state, history, zstep)
