"""Preemption: SIGTERM / SIGINT end the run after the current step, with a checkpoint."""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["Preempted", "PreemptionGuard"]


class Preempted(Exception):  # a control-flow signal, not an error
    """The run stopped on a signal after writing a checkpoint at ``step``."""

    def __init__(self, step: int, signum: int, directory: str | None):
        self.step, self.signum, self.directory = step, signum, directory
        name = signal.Signals(signum).name
        where = f"checkpoint saved in {directory}; run the same command to resume" \
            if directory else "no --run-dir, so nothing was saved"
        super().__init__(f"stopped by {name} after step {step}: {where}")


class PreemptionGuard:
    """Records SIGTERM / SIGINT instead of dying; the loop checks :attr:`signum` per step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
