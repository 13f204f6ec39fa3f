"""Reward functions as Hugging Face TRL calls them, ``f(prompts, completions, **columns) ->
list[float | None]``, loaded by name, called with the data's other columns, their answers
checked; and two built-ins: :func:`exact_answer` and :func:`format_reward`.

A function that raises, returns something other than one number (or None) per completion,
or returns a NaN stops the run with :class:`RewardError` naming it, the way it failed and
the first completion concerned: never a traceback from inside the training step.
"""

from __future__ import annotations

import importlib
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
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise RewardError(f"reward function {name} returned {v!r} for completion {i}; "
                              "expected a finite float or None")
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

    def __call__(self, prompts: list, completions: list, columns: dict[str, list]
                 ) -> tuple[np.ndarray, dict[str, float]]:
        """``(rewards [n], {"rewards/<function>": mean})``: the weighted sum of the
        functions' rewards (None counts 0, as TRL's ``nansum``) and each one's mean over the
        completions it applies to (NaN where it applies to none)."""
        n = len(completions)
        per = np.empty((n, len(self.functions)), np.float64)
        for j, (name, fn) in enumerate(zip(self.names, self.functions, strict=True)):
            try:
                values = fn(prompts=prompts, completions=completions, **columns)
            except Exception as e:  # the user's code: one line naming it
                raise RewardError(f"reward function {name} raised {type(e).__name__}: "
                                  f"{first_line(e)}") from None
            per[:, j] = _checked(name, values, n)
        total = np.nansum(per * self.weights[None, :], axis=1)
        means = {}
        for j, name in enumerate(self.names):
            col = per[:, j]
            short_name = name.rpartition(":")[2]
            means[f"rewards/{short_name}"] = float(np.nanmean(col)) if np.any(
                ~np.isnan(col)) else float("nan")
        return total, means
