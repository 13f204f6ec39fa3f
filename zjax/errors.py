"""Exceptions raised by zjax.

Every error subclasses a builtin so callers can catch it generically, and every message names
the offending key (or leaf, or file), the value given and what was expected.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["CheckpointError", "ConfigError", "NonFiniteError", "NotGatheredError", "ZjaxError",
           "did_you_mean"]


class ZjaxError(Exception):
    """Base class of zjax's own errors."""


class ConfigError(ZjaxError, ValueError):
    """A configuration value is missing, of the wrong type, or not allowed."""


class CheckpointError(ZjaxError, OSError):
    """A checkpoint cannot be read, written or matched to the current run."""


class NotGatheredError(ZjaxError, ValueError):
    """A model used a sharded parameter without gathering it first."""


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class NonFiniteError(ZjaxError, ArithmeticError):
    """Training produced a non-finite loss, gradient or parameter (``train.on_nonfinite``)."""
