"""Stopping a command that writes an output (``zjax tokenize``, ``zjax import-hf``) on
SIGINT or SIGTERM: its partial output removed, its worker processes ended, exit 128 + N.

:func:`stoppable` turns the two signals into :class:`Stopped` (a ``BaseException``, which no
``except Exception`` swallows), so every ``finally`` and ``except BaseException`` on the way
runs: the writers remove what they built beside the output, the worker pools terminate their
processes. While it unwinds the signals are ignored (a second Ctrl-C cannot cut the clean-up
short). :func:`deferred` holds a signal back over a span that must not be cut (a library
writing in its own threads); the signal is raised where the span ends, or at the next
:func:`interruptible` item. Worker processes call :func:`worker_start`: they ignore SIGINT (the
terminal sends it to the whole process group; the parent ends them) and die with the parent
(``PR_SET_PDEATHSIG``, Linux), so not even a ``kill -9`` of the parent leaves them running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable, Iterator

__all__ = ["Stopped", "deferred", "interruptible", "stop_point", "stoppable", "worker_start"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"defer": 0, "pending": None, "raised": None}


class Stopped(BaseException):
    """The command was stopped by signal ``signum`` (its exit code is ``128 + signum``)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def _handle(signum, frame) -> None:
    if _state["defer"]:
        _state["pending"] = _state["pending"] or signum
        return
    _raise(signum)


def _raise(signum: int) -> None:
    for s in _SIGNALS:  # the clean-up that follows is not cut short by a second signal
        signal.signal(s, signal.SIG_IGN)
    # kept: Python swallows an exception a signal handler raises inside a garbage
    # collector's callback or a __del__ ("Exception ignored in ..."), and the command
    # would run on to its end; the next stop_point raises it again
    _state["raised"] = signum
    raise Stopped(signum)


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` in the block (main thread only; elsewhere
    the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handle) for s in _SIGNALS}
    _state.update(defer=0, pending=None, raised=None)
    try:
        yield
    finally:
        _state.update(defer=0, pending=None, raised=None)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _pending() -> None:
    signum, _state["pending"] = _state["pending"], None
    if signum is not None and not _state["defer"]:
        _raise(signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal that arrives in the block is raised where the block ends."""
    _state["defer"] += 1
    try:
        yield
    finally:
        _state["defer"] -= 1
        if not _state["defer"] and _state["pending"] is not None:
            _pending()


def stop_point() -> None:
    """Raise a held-back signal now (inside a :func:`deferred` block too), or one whose
    :class:`Stopped` was swallowed on the way (raised in a garbage collector's callback): the
    last point where stopping still leaves nothing behind (before an output is committed)."""
    signum, _state["pending"] = _state["pending"], None
    if signum is None:
        signum = _state["raised"]
    if signum is not None:
        _raise(signum)


def interruptible(items: Iterable) -> Iterator:
    """``items``, with a held-back signal raised before each is produced and signals raised
    at once while it is produced (inside a :func:`deferred` block)."""
    it = iter(items)
    done = object()
    while True:
        held, _state["defer"] = _state["defer"], 0
        try:
            _pending()
            item = next(it, done)
        finally:
            _state["defer"] = held
        if item is done:
            return
        yield item


def worker_start() -> None:
    """In a worker process: ignore SIGINT (the parent stops the workers) and end with the
    parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's clean-up ends the workers
        return
    if os.getppid() != parent:  # the parent died before the request
        os._exit(1)
