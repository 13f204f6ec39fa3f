"""``train.on_nonfinite``: what the loop does when an update is not finite.

Each step reports ``finite`` (its loss, gradients and new params are all finite). Reading that
flag at once would make the host wait for every step, so :class:`FiniteWatch` keeps the flags of
the steps in flight and reads those already computed (``poll``); before a checkpoint is saved,
and wherever the host waits anyway, it reads them all (``poll(wait=True)``). So a non-finite
state is never saved, and the step that went wrong is named exactly.

- ``stop``: the first non-finite step ends the run with :class:`~zjax.errors.NonFiniteError`;
  checkpoints already written (all finite) are kept.
- ``skip``: the step compiled with ``skip_nonfinite`` dropped that update (the state is the one
  before it); the watch counts such steps and stops after ``max_skips`` in a row. The counts
  are saved with each checkpoint, so a resumed run goes on counting.
"""

from __future__ import annotations

import logging

import jax

from zjax.errors import NonFiniteError

__all__ = ["FiniteWatch"]

log = logging.getLogger("zjax")


class FiniteWatch:
    """Reads each step's ``finite`` flag without making every step wait.

    Args:
      policy: ``stop`` or ``skip``.
      max_skips: with ``skip``, the most non-finite steps in a row before the run stops.
      lockstep: read each flag one step late, waiting for it (several processes must all raise
        at the same step, so what they read cannot depend on when a flag happens to be ready;
        one step stays in flight).
    """

    def __init__(self, policy: str, *, max_skips: int, lockstep: bool = False):
        self.policy, self.max_skips, self.lockstep = policy, max_skips, lockstep
        self.pending: list[tuple[int, dict]] = []
        self.skipped = 0  # in total
        self.in_a_row = 0

    def add(self, step: int, metrics: dict) -> None:
        """Record the metrics of ``step`` (device arrays; nothing is read yet)."""
        self.pending.append((step, {k: metrics[k] for k in ("finite", "loss", "grad_norm",
                                                             "param_norm")}))

    def poll(self, *, wait: bool = False) -> None:
        """Read the flags of finished steps (all of them with ``wait``), oldest first.

        Raises:
          NonFiniteError: with ``stop``, a step was not finite; with ``skip``, more than
            ``max_skips`` steps in a row were not.
        """
        while self.pending:
            step, m = self.pending[0]
            if self.lockstep and not wait and len(self.pending) == 1:
                return  # the newest step: read at the next one
            if not self.lockstep and not wait and not m["finite"].is_ready():
                return
            self.pending.pop(0)
            if bool(m["finite"]):
                self.in_a_row = 0
                continue
            got = jax.device_get(m)
            values = {k: float(got[k]) for k in ("loss", "grad_norm", "param_norm")}
            what = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
            if self.policy == "stop":
                raise NonFiniteError(
                    f"train.on_nonfinite: stop: step {step} is not finite ({what}); stopped "
                    "without saving it (the checkpoints written before it are kept). Lower "
                    "optimizer.lr, set optimizer.clip_norm, or set train.on_nonfinite: skip")
            self.skipped += 1
            self.in_a_row += 1
            log.warning("step %d is not finite (%s): its update was skipped (%d in a row)",
                        step, what, self.in_a_row)
            if self.in_a_row > self.max_skips:
                raise NonFiniteError(
                    f"train.max_skips: {self.in_a_row} steps in a row up to step {step} were not "
                    f"finite ({what}), more than {self.max_skips}; stopped (the state is the one "
                    f"before step {step - self.in_a_row + 1}, and every checkpoint is finite)")
