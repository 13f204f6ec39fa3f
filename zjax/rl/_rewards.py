"""Reward functions as Hugging Face TRL calls them, ``f(prompts, completions, **columns) ->
list[float | None]``, loaded by name, called with the data's other columns, their answers
checked; and two built-ins: :func:`exact_answer` and :func:`format_reward`.

A reward may be a bool, taken as 0 or 1 (TRL's ``torch.tensor(..., dtype=float32)`` does:
``[c == a for ...]`` is a common reward). A function that raises (``sys.exit()`` too: a
reward function does not end the run), returns something other than one number (or None)
per completion, or returns a NaN stops the run with :class:`RewardError` naming it, the way
it failed and the first completion concerned: never a traceback from inside the training
step. Completions for which every function returns None count 0 (TRL's ``nansum``), which
is said in one warning, the first time (TRL warns too).
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zjax.errors import ConfigError, RewardError, first_line

__all__ = ["RewardError", "Rewards", "exact_answer", "format_reward", "load_reward"]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _final(text: str) -> str | None:
    """A completion's final answer: its last ``\\boxed{}``, else its last number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers_ = _NUMBER.findall(text)
    return numbers_[-1] if numbers_ else None


def _text(completion: Any) -> str:
    """A completion as text: a string, or TRL's conversational ``[{role, content}]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_answer(prompts: Sequence, completions: Sequence, answer: Sequence, **_) -> list:
    """1.0 where a completion's final answer (its last ``\\boxed{...}``, else its last
    number) equals the row's ``answer`` column (as numbers where both are, else as text),
    0.0 elsewhere; None where the row has no answer."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        if want is None:
            out.append(None)
            continue
        got = _final(_text(completion))
        a, b = _number(str(got)) if got is not None else None, _number(str(want))
        same = (a == b) if a is not None and b is not None else got == str(want).strip()
        out.append(1.0 if same else 0.0)
    return out


def format_reward(prompts: Sequence, completions: Sequence, *,
                  pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$",
                  **_) -> list:
    """1.0 where a completion matches ``pattern`` (DeepSeek-R1's think/answer tags by
    default; a regular expression, matched whole, ``.`` spanning lines), else 0.0. Give
    another pattern with ``functools.partial`` in your own module."""
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def load_reward(name: str, *, key: str = "rl.rewards") -> Callable:
    """The callable ``package.module:function`` names (imported: its module's code runs)."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: {name}: cannot import {module_name} ({first_line(e)})") \
            from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {name}: {module_name} has no function {attr!r}")
    return fn


def _checked(name: str, values: Any, n: int) -> np.ndarray:
    """A function's rewards as float64 ``[n]`` (None as NaN), or a RewardError naming it."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, list | tuple) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list | tuple) \
            else type(values).__name__
        raise RewardError(f"reward function {name} returned {got} for {n} completions; "
                          "expected a list of one float (or None) per completion")
    out = np.empty(n, np.float64)
    for i, v in enumerate(values):
        if v is None:
            out[i] = np.nan
            continue
        if isinstance(v, bool | np.bool_):  # TRL's float32 tensor of them: 0 or 1
            out[i] = float(v)
            continue
        if not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise RewardError(f"reward function {name} returned {v!r} for completion {i}; "
                              "expected a finite float, a bool or None")
        out[i] = float(v)
    return out


class Rewards:
    """The ``rl.rewards`` functions with their weights.

    Args:
      names: ``package.module:function`` names.
      weights: one per function.
    """

    def __init__(self, names: Sequence[str], weights: Sequence[float]):
        self.names = list(names)
        self.functions = [load_reward(n) for n in names]
        self.weights = np.asarray(weights, np.float64)
        self.warned_none = False  # every function None for a completion: said once

    def __call__(self, prompts: list, completions: list, columns: dict[str, list]
                 ) -> tuple[np.ndarray, dict[str, float]]:
        """``(rewards [n], {"rewards/<function>": mean})``: the weighted sum of the
        functions' rewards (None counts 0, as TRL's ``nansum``) and each one's mean over the
        completions it applies to (NaN where it applies to none)."""
        n = len(completions)
        per = np.empty((n, len(self.functions)), np.float64)
        for j, (name, fn) in enumerate(zip(self.names, self.functions, strict=True)):
            per[:, j] = _checked(name, _call(name, fn, prompts, completions, columns), n)
        self._warn_none(per, prompts)
        total = np.nansum(per * self.weights[None, :], axis=1)
        means = {}
        for j, name in enumerate(self.names):
            col = per[:, j]
            short_name = name.rpartition(":")[2]
            means[f"rewards/{short_name}"] = float(np.nanmean(col)) if np.any(
                ~np.isnan(col)) else float("nan")
        return total, means

    def _warn_none(self, per: np.ndarray, prompts: list) -> None:
        """Warn (once) where every function gave a completion None: it counts 0, so a group
        with none trains on nothing, as in TRL, which warns of it too."""
        none = np.isnan(per).all(axis=1)
        if self.warned_none or not none.any():
            return
        self.warned_none = True
        first = int(np.argmax(none))
        logging.getLogger("zjax").warning(
            "rl.rewards: every reward function (%s) returned None for %d of %d completions "
            "(the first: completion %d, of prompt %s): each counts as reward 0 (as in TRL), "
            "so a group with no reward has advantages 0 and teaches nothing (said once)",
            ", ".join(self.names), int(none.sum()), len(none), first,
            repr(prompts[first])[:80])


def _call(name: str, fn: Callable, prompts: list, completions: list,
          columns: dict[str, list]) -> Any:
    """``fn``'s rewards; its failure, ``sys.exit()`` included, as one RewardError naming
    it (KeyboardInterrupt goes on: it is the user's Ctrl-C, not the function's)."""
    try:
        return fn(prompts=prompts, completions=completions, **columns)
    except SystemExit as e:  # not an Exception: it would end the run with no message
        code = "" if e.code is None else repr(e.code)
        raise RewardError(f"reward function {name} called sys.exit({code}): a reward "
                          "function returns its rewards, it does not end the run") from None
    except Exception as e:  # the user's code: one line naming it
        raise RewardError(f"reward function {name} raised {type(e).__name__}: "
                          f"{first_line(e)}") from None
