"""The trainer's hooks (:mod:`zjax.training._hooks`): metrics rows, evaluation, checkpoints,
progress, preemption. Each holds only what its job needs."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zjax.checkpoint import Checkpointer
from zjax.training._hooks import StepInfo
from zjax.training._metrics import MetricsWriter
from zjax.training._nonfinite import FiniteWatch
from zjax.training._preempt import Preempted, PreemptionGuard

__all__ = ["Checkpoints", "Evaluation", "MetricsLog", "Progress", "preemption"]

log = logging.getLogger("zjax")


class Progress:
    """A rich progress bar on a terminal (process 0 only); nothing elsewhere."""

    def __init__(self, total: int, *, start: int, enabled: bool):
        self.bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        console = Console()
        if not console.is_terminal:
            return
        self.bar = Bar(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("loss {task.fields[loss]}"),
                       TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn(),
                       console=console)
        self.task = self.bar.add_task("train", total=total, completed=start, loss="-", tps="-")

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, s: StepInfo) -> None:
        """The hook: advance; show the loss and throughput of a logged step."""
        if self.bar is None:
            return
        fields = {}
        if "loss" in s.row:
            fields = {"loss": f"{s.row['loss']:.4f}", "tps": f"{s.row['tokens_per_s']:,.0f}"}
        self.bar.update(self.task, completed=s.step, **fields)


class MetricsLog:
    """The logged rows: the step's metrics, learning rate and throughput, the compiled step's
    memory; written to the run directory, printed, and kept as the run's history.

    Args:
      writer: where rows go (``metrics.jsonl``, TensorBoard).
      schedule: the learning-rate schedule (the row's ``lr``).
      tokens_per_step: tokens in one global batch.
      memory: the compiled step's memory figures, added to each metrics row.
      watch: the non-finite watch (read up to the logged step; its skip count is logged).
      info: prints (process 0; a no-op elsewhere).
      flops: the plan report's ``flops``: each row gets ``model_flops_per_s``, and ``mfu``
        when the chip's peak is known (over ``n_devices``).
    """

    def __init__(self, writer: MetricsWriter, *, schedule: Callable, tokens_per_step: int,
                 memory: dict, watch: FiniteWatch, info: Callable, flops: dict | None = None,
                 n_devices: int = 1):
        self.writer, self.schedule, self.tokens = writer, schedule, tokens_per_step
        self.memory, self.watch, self.info = memory, watch, info
        self.flops, self.n_devices = flops or {}, n_devices
        self.history: list[dict] = []
        self._t0, self._done, self._paused = time.perf_counter(), 0, 0.0

    def count(self, s: StepInfo) -> None:
        """Every step: one more step in the current throughput interval."""
        self._done += 1

    def pause(self, seconds: float) -> None:
        """Take ``seconds`` (spent evaluating) out of the current interval."""
        self._paused += seconds

    def metrics(self, s: StepInfo) -> None:
        """Every ``train.log_every`` steps: read the metrics (this waits for the step)."""
        row = {k: float(v) for k, v in s.metrics.items() if k not in ("count", "finite")}
        row["loss_tokens"] = float(s.metrics["count"])  # the targets the loss averages over
        self.watch.poll(wait=True)
        dt = time.perf_counter() - self._t0 - self._paused
        s.row.update(row, lr=float(self.schedule(s.step - 1)),
                     tokens_per_s=self._done * self.tokens / dt, step_time_s=dt / self._done)
        if self.flops.get("per_token"):  # model FLOPs utilisation (zjax.planning._flops)
            s.row["model_flops_per_s"] = s.row["tokens_per_s"] * self.flops["per_token"]
            if self.flops.get("peak_per_device"):
                s.row["mfu"] = s.row["model_flops_per_s"] / (
                    self.flops["peak_per_device"] * self.n_devices)
        if self.watch.policy == "skip":
            s.row["skipped_steps"] = self.watch.skipped
        s.row.update(self.memory)
        self._t0, self._done, self._paused = time.perf_counter(), 0, 0.0

    def write(self, s: StepInfo) -> None:
        """Every step: write and print the row if a hook filled one."""
        if not s.row:
            return
        row = {"step": s.step, **s.row}
        self.history.append(row)
        self.writer.write(row)  # process 0 with a run directory; else a no-op
        evals = f" | eval {row['eval_loss']:.4f}" if "eval_loss" in row else ""
        if "eval_rewards/accuracies" in row:  # a preference run's
            evals += f" (reward accuracy {row['eval_rewards/accuracies']:.3f})"
        evals += _rollout_line(row)
        if "loss" in row:
            nvme = (f" | NVMe read {row['nvme_read_gbs']:.2f} / write "
                    f"{row['nvme_write_gbs']:.2f} GB/s" if "nvme_read_gbs" in row else "")
            self.info("step %5d | loss %.4f%s | %8.0f tok/s | %.3f s/step%s", s.step, row["loss"],
                      evals, row["tokens_per_s"], row["step_time_s"], nvme)
        else:
            self.info("step %5d%s", s.step, evals)


class Evaluation:
    """Every ``train.eval_every`` steps: the mean loss over ``n_batches`` held-out batches
    (``eval_loss``) and of the loss's own metrics (``eval_<name>``: a preference run's
    ``eval_rewards/accuracies``, as Hugging Face's trainers name them).

    Args:
      evaluate: ``evaluate(params, batch, frozen) -> (mean loss, {metric: value})``.
      batches: the held-out global batches.
      n_batches: batches per evaluation.
      log: its time is taken out of the throughput interval.
    """

    def __init__(self, evaluate: Callable, batches: Iterator, *, n_batches: int,
                 log: MetricsLog):
        self.evaluate, self.batches, self.n, self.log = evaluate, batches, n_batches, log

    def __call__(self, s: StepInfo) -> None:
        t0 = time.perf_counter()
        state = s.state
        rows = [self.evaluate(state.params, next(self.batches), state.frozen)
                for _ in range(self.n)]
        s.row["eval_loss"] = float(np.mean([float(loss) for loss, _ in rows]))
        for name in rows[0][1]:
            s.row[f"eval_{name}"] = float(np.mean([float(m[name]) for _, m in rows]))
        self.log.pause(time.perf_counter() - t0)


class Checkpoints:
    """Every ``checkpoint.every`` steps and at the last: save the state, the data iterators'
    positions and the skip counts. A non-finite state is never saved.

    Args:
      ckpt: the run's checkpointer.
      save: ``save(step, state)``, the checkpointer's save with this run's metadata.
      watch: read up to the step before saving.
      saved: the newest step saved (the resumed one), or None.
    """

    def __init__(self, ckpt: Checkpointer, save: Callable[[int, Any], None], *,
                 watch: FiniteWatch, saved: int | None):
        self.ckpt, self._save, self.watch, self.saved = ckpt, save, watch, saved

    def __call__(self, s: StepInfo) -> None:
        self.watch.poll(wait=True)
        self._save(s.step, s.state)
        self.saved = s.step

    def committed(self) -> int | None:
        """Wait for the saves in flight; the newest step on disk."""
        self.ckpt.wait()
        steps = self.ckpt.steps()
        return steps[-1] if steps else None


def preemption(guard: PreemptionGuard, checkpoints: Checkpoints | None
               ) -> Callable[[StepInfo], None]:
    """The hook, every step on every process: after a signal, save and raise
    :class:`~zjax.training._preempt.Preempted` at the step all processes agree on."""

    def check(s: StepInfo) -> None:
        if not guard.reached(s.step) or s.last:
            return
        if checkpoints is None:
            raise Preempted(s.step, guard.signum, None, None)
        if checkpoints.saved != s.step:
            checkpoints(s)
        raise Preempted(s.step, guard.signum, str(checkpoints.ckpt.directory),
                        checkpoints.committed())

    return check


def _rollout_line(row: dict) -> str:
    """A GRPO row's reward and the time split of a step (empty for other runs); a time not
    measured yet (the first rollout's training: it is timed at the next rollout) is ``-``."""
    if "reward" not in row:
        return ""
    seconds = [row.get(f"time_{k}_s", math.nan) for k in ("generate", "score", "train")]
    times = "/".join(f"{s:.3f}" if math.isfinite(s) else "-" for s in seconds)
    return f" | reward {row['reward']:.3f} | generate/score/train {times} s"
