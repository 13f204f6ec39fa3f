"""The training run: ``zjax.train`` as a generator of steps with hooks (metrics, evaluation,
checkpoints, progress, preemption), the non-finite watch, the locked run directory and its
``metrics.jsonl`` / TensorBoard logs.

It imports the task (``zjax.task``), planning, checkpoint, hf and the layers below them, never
the command line. Names load on first use (the CLI's Ctrl-C handler needs ``PreemptionGuard``
within milliseconds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports

_LAZY = {
    "Hook": "zjax.training._hooks",
    "MetricsWriter": "zjax.training._metrics",
    "Preempted": "zjax.training._preempt",
    "PreemptionGuard": "zjax.training._preempt",
    "RunDir": "zjax.training._rundir",
    "StepInfo": "zjax.training._hooks",
    "TrainResult": "zjax.training.trainer",
    "atomic_write": "zjax.training._rundir",
    "read_metrics": "zjax.training._metrics",
    "run_hooks": "zjax.training._hooks",
    "train": "zjax.training.trainer",
    "training_steps": "zjax.training._hooks",
}

__all__ = [
    "Hook",
    "MetricsWriter",
    "Preempted",
    "PreemptionGuard",
    "RunDir",
    "StepInfo",
    "TrainResult",
    "atomic_write",
    "read_metrics",
    "run_hooks",
    "train",
    "training_steps",
]


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from zjax.training._hooks import Hook, StepInfo, run_hooks, training_steps
    from zjax.training._metrics import MetricsWriter, read_metrics
    from zjax.training._preempt import Preempted, PreemptionGuard
    from zjax.training._rundir import RunDir, atomic_write
    from zjax.training.trainer import TrainResult, train
