"""Exceptions raised by zjax.

Every error subclasses a builtin so callers can catch it generically, and every message names
the offending key (or leaf, or file), the value given and what was expected.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable

__all__ = ["ArgumentError", "CheckpointError", "ConfigError", "DamagedCheckpoint",
           "DoesNotFitError", "GatherFallbackWarning", "NonFiniteError", "NotGatheredError",
           "RewardError", "ZjaxError", "did_you_mean", "first_line", "is_damage"]


class ZjaxError(Exception):
    """Base class of zjax's own errors."""


class ConfigError(ZjaxError, ValueError):
    """A configuration value is missing, of the wrong type, or not allowed."""


class ArgumentError(ConfigError):
    """An argument of an engine function (``make_step``'s ``micro_batches``, a batch, a mesh)
    does not fit.

    The engine names its own arguments; the config layer (:func:`zjax.build_step`, the
    trainer, the planner) renames them to the config keys they came from (:meth:`renamed`).

    Attributes:
      argument: the argument's name.
      detail: what is wrong and what would fit.
    """

    def __init__(self, argument: str, detail: str):
        super().__init__(f"{argument}: {detail}")
        self.argument, self.detail = argument, detail

    def renamed(self, keys: dict[str, str]) -> ConfigError:
        """The same error naming the config key ``keys`` maps the argument to."""
        return ConfigError(f"{keys.get(self.argument, self.argument)}: {self.detail}")


class DoesNotFitError(ConfigError):
    """The compiler refused a step over the device memory (libtpu); ``temp_bytes``: the
    temporaries it said the step needs, where it said."""

    def __init__(self, message: str, *, temp_bytes: int | None = None):
        super().__init__(message)
        self.temp_bytes = temp_bytes


class CheckpointError(ZjaxError, OSError):
    """A checkpoint cannot be read, written or matched to the current run."""


class NvmeError(ZjaxError, OSError):
    """The NVMe swap files could not be read or written (a full or failing disk)."""


class NotGatheredError(ZjaxError, ValueError):
    """A model used a sharded parameter without gathering it first."""


class GatherFallbackWarning(UserWarning):
    """ZeRO-3 could not schedule a model's gathers layer by layer: it gathers them all at once
    (correct, but the whole model is materialised on every device)."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of ``e``'s message, at most ``limit`` characters ("" if it has none)."""
    return str(e).splitlines()[0][:limit] if str(e).strip() else ""


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class NonFiniteError(ZjaxError, ArithmeticError):
    """Training produced a non-finite loss, gradient or parameter (``train.on_nonfinite``)."""


class RewardError(ZjaxError, RuntimeError):
    """An RL reward function failed: it raised, or gave no valid reward list (the message
    names it; the run stops as on bad input)."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's files are missing, unreadable, or read back other values than written."""


# Tensorstore reports unreadable array data with these absl status codes (Orbax wraps its
# error in a bare Exception: "Encountered error while reading array index ...")
_READ_FAILURES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "INVALID_ARGUMENT: Error reading",
                  "INVALID_ARGUMENT: Error decoding", "FAILED_PRECONDITION: Error reading")


def is_damage(e: BaseException) -> bool:
    """Whether ``e``, raised while *reading* a checkpoint, means its files are damaged.

    Damage: a file missing or cut short, data or metadata that does not decode, a checksum
    mismatch. Not damage: anything else, e.g. an I/O error of the filesystem (EIO, EACCES,
    ESTALE: retrying may work, and the checkpoint may be intact) or a bug; those surface.
    """
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DamagedCheckpoint | json.JSONDecodeError | UnicodeDecodeError
                      | FileNotFoundError):
            return True
        if isinstance(e, ValueError | RuntimeError) and str(e).startswith(_READ_FAILURES):
            return True
        e = e.__cause__ or e.__context__
    return False
