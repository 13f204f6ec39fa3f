"""The training loop as a generator of steps, and hooks that run on some of them.

Cf. levanter's ``Trainer.training_steps`` and its hooks with ``every=``: the loop only runs the
compiled step; what happens around it (the non-finite watch, metrics, evaluation, checkpoints,
progress, preemption) is a :class:`Hook`, each in its own small piece of code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

__all__ = ["Hook", "StepInfo", "run_hooks", "training_steps"]


class StepInfo(NamedTuple):
    """One step just taken.

    Attributes:
      step: optimizer steps taken so far (1 after the first).
      state: the new train state.
      metrics: the step's metrics (device arrays, not read yet).
      last: whether this is the run's last step.
      row: what the hooks log for this step; written when a hook put something in it.
    """

    step: int
    state: Any
    metrics: dict[str, Any]
    last: bool
    row: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(info)`` every ``every`` steps and at the last one (``every=0``: the last only)."""

    fn: Callable[[StepInfo], None]
    every: int = 1

    def due(self, info: StepInfo) -> bool:
        return info.last or (self.every > 0 and info.step % self.every == 0)


def training_steps(step_fn: Callable, state: Any, batches: Iterable, *, start: int, steps: int
                   ) -> Iterator[StepInfo]:
    """Run ``state, metrics = step_fn(state, batch)`` from step ``start`` to ``steps``.

    ``batches`` gives one global batch per step. Each step is yielded before the next is
    dispatched, so a hook sees the state of its own step.
    """
    it = iter(batches)
    for i in range(start, steps):
        state, metrics = step_fn(state, next(it))
        yield StepInfo(i + 1, state, metrics, i + 1 == steps, {})


def run_hooks(hooks: Iterable[Hook], info: StepInfo) -> None:
    """Call the hooks due at ``info``'s step, in order."""
    for hook in hooks:
        if hook.due(info):
            hook.fn(info)
