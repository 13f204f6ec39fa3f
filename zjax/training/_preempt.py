"""Preemption: SIGTERM / SIGINT end the run at a step every process agrees on, with a checkpoint.

One process: a Python handler records the signal and the loop stops after the step it is in.
Several processes (``jax.distributed``): they must stop at the *same* step, or the collective
checkpoint save deadlocks. JAX's own preemption service does this: its C++ notifier catches
SIGTERM on any process, the coordination service tells every process, and
``multihost_utils.reached_preemption_sync_point(step)`` turns true at the same step (the largest
step any process had reached, plus one) everywhere. So with several processes SIGTERM is left to
that notifier (a Python handler would replace it), and SIGINT is turned into SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

__all__ = ["Preempted", "PreemptionGuard"]

REPEAT_S = 2.0  # a second SIGINT sooner than this after the first is a duplicate


class Preempted(Exception):  # a control-flow signal, not an error
    """The run stopped on a signal at ``step``; ``saved`` is the step of its last checkpoint.

    Attributes:
      step: the step the run stopped after.
      signum: the signal (SIGTERM for a process told by another one).
      directory: the checkpoint directory, or None without a run directory.
      saved: the step of the newest committed checkpoint (``step`` when the stop saved one),
        None when nothing was saved.
    """

    def __init__(self, step: int, signum: int, directory: str | None, saved: int | None):
        self.step, self.signum, self.directory, self.saved = step, signum, directory, saved
        name = signal.Signals(signum).name
        if directory is None:
            where = "no --run-dir, so nothing was saved"
        elif saved is None:
            where = f"no checkpoint was saved in {directory}"
        else:
            where = (f"checkpoint of step {saved} saved in {directory}; run the same command "
                     "to resume")
        super().__init__(f"stopped by {name} after step {step}: {where}")


def _sync_manager():
    """JAX's preemption sync manager when this process is one of several, else None."""
    import jax
    from jax._src import distributed

    if jax.process_count() <= 1:
        return None
    return distributed.global_state.preemption_sync_manager


class PreemptionGuard:
    """Records SIGTERM / SIGINT; :meth:`reached` says when every process should stop.

    Use as a context manager around the training loop and call :meth:`reached` once per step,
    on every process, with the step just completed.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}
        self._manager = None
        self._fallback = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is not None and signum == signal.SIGINT:
            # a second Ctrl-C stops at once; one a moment after the first is the same Ctrl-C
            # arriving twice (the terminal signals the whole process group, and `zjax launch`
            # forwards it to its children again)
            if now - self._first < REPEAT_S:
                return
            raise KeyboardInterrupt
        self.signum, self._first = signum, now
        if self._manager is not None and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells the other processes

    def __enter__(self) -> PreemptionGuard:
        import jax

        self._manager = _sync_manager()
        # several processes but no preemption service: agree by an all-gather every step
        self._fallback = jax.process_count() > 1 and self._manager is None
        if threading.current_thread() is threading.main_thread():
            ours = (signal.SIGINT,) if self._manager is not None else (
                signal.SIGTERM, signal.SIGINT)
            for sig in ours:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def reached(self, step: int) -> bool:
        """Whether the run stops after ``step`` (the same answer on every process)."""
        if self._manager is not None:
            if self._manager.reached_sync_point(step):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        if self._fallback:
            import numpy as np
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.int32(self.signum or 0))
            if np.any(flags):
                self.signum = self.signum or int(np.max(flags))
                return True
            return False
        return self.signum is not None
