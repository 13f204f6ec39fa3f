"""Typed config sections from plain dicts: the one place where key, type and range checks happen.

A section is a frozen dataclass. Its fields declare what they allow as field metadata:
:func:`choices` (one of a few values), :func:`positive`, :func:`non_negative` and
:func:`interval` (numeric ranges); every float must be finite. :func:`from_dict` builds a
section from a mapping, rejecting unknown keys (with a "did you mean"), values of the wrong
type and values outside what the field allows; :func:`validate`, called from a section's
``__post_init__``, applies the same checks when the dataclass is constructed directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import os
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from zjax.errors import ConfigError, did_you_mean

__all__ = ["Bounds", "choices", "from_dict", "interval", "non_negative", "positive", "short",
           "to_dict", "validate"]

T = TypeVar("T")

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40


def short(value: Any, limit: int = 200) -> str:
    """A repr of ``value`` for an error message: never more than ``limit`` characters.

    Nested containers are cut at a few levels and items without being expanded first, so a
    value that YAML aliases made huge prints in constant time.
    """
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The numbers a field allows: a lower bound (``gt`` or ``ge``), an upper one (``lt`` or
    ``le``), and special values outside them (``also``, e.g. -1 for "all the rest").

    Attributes:
      gt: exclusive lower bound.
      ge: inclusive lower bound.
      lt: exclusive upper bound.
      le: inclusive upper bound.
      also: values allowed beyond the bounds.
      none_means: what null means, for the message of a field that may be null.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    also: tuple = ()
    none_means: str | None = None

    def allows(self, v: float) -> bool:
        if v in self.also:
            return True
        return ((self.gt is None or v > self.gt) and (self.ge is None or v >= self.ge)
                and (self.lt is None or v < self.lt) and (self.le is None or v <= self.le))

    def describe(self) -> str:
        """``> 0``, ``>= 0``, ``in [0, 1)``, ``> 0 or -1``."""
        low = ("(", self.gt) if self.gt is not None else ("[", self.ge)
        high = (self.lt, ")") if self.lt is not None else (self.le, "]")
        if low[1] is not None and high[0] is not None:
            text = f"in {low[0]}{low[1]}, {high[0]}{high[1]}"
        elif low[1] is not None:
            text = f"{'>' if low[0] == '(' else '>='} {low[1]}"
        else:
            text = f"{'<' if high[1] == ')' else '<='} {high[0]}"
        return text + "".join(f" or {a}" for a in self.also)


def _field(default: Any, **metadata: Any) -> Any:
    return dataclasses.field(default=default, metadata=metadata)


def choices(*allowed: Any, default: Any) -> Any:
    """A dataclass field whose value must be one of ``allowed``."""
    return _field(default, choices=allowed)


def positive(default: Any, *, also: tuple = (), none_means: str | None = None) -> Any:
    """A numeric dataclass field that must be > 0 (or one of ``also``)."""
    return _field(default, bounds=Bounds(gt=0, also=also, none_means=none_means))


def non_negative(default: Any, *, none_means: str | None = None) -> Any:
    """A numeric dataclass field that must be >= 0."""
    return _field(default, bounds=Bounds(ge=0, none_means=none_means))


def interval(lo: float, hi: float, *, default: Any, closed: str = "[)",
             none_means: str | None = None) -> Any:
    """A numeric dataclass field that must lie between ``lo`` and ``hi``.

    Args:
      lo: lower end.
      hi: upper end.
      default: the field's default.
      closed: which ends are included, as in interval notation: ``[)``, ``[]``, ``()``, ``(]``.
      none_means: what null means, when the field may be null.
    """
    if closed not in ("[)", "[]", "()", "(]"):
        raise ValueError(f"closed must be one of [), [], (), (], got {closed!r}")
    lower = {"ge": lo} if closed[0] == "[" else {"gt": lo}
    upper = {"lt": hi} if closed[1] == ")" else {"le": hi}
    return _field(default, bounds=Bounds(**lower, **upper, none_means=none_means))


def _type_name(tp: Any) -> str:
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    return f"{short(value)} ({type(value).__name__})"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; ints are accepted for floats, integral
    floats (``1e4``) for ints, and numbers written as strings for both."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            with contextlib.suppress(ConfigError):
                return _coerce(value, arg, key)
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {names}, got {_got(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, prefix=key)
    if tp in (int, float) and isinstance(value, str):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 1e-3 and 1e4 as strings
            value = float(value) if tp is float else _int_text(value)
    if tp is float:  # numbers.Real: numpy scalars too
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{key}: expected a number, got {_got(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, float) and value.is_integer():  # 1e5 in YAML is a float
            return int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{key}: expected an integer, got {_got(value)}")
        return int(value)
    if tp is str and isinstance(value, os.PathLike):  # data.path=Path(...)
        return os.fspath(value)
    if tp in (bool, str) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {_got(value)}")
    return value


def _int_text(text: str) -> int | str:
    """``"12"`` -> 12, ``"1e4"`` -> 10000; any other text is returned as it is."""
    with contextlib.suppress(ValueError):
        return int(text)
    number = float(text)
    return int(number) if number.is_integer() else text


def _check(field: dataclasses.Field, value: Any, key: str, bounds: Bounds | None = None) -> None:
    """Raise if ``value`` (already of the field's type) is not one the field allows."""
    allowed = field.metadata.get("choices")
    if allowed is not None and value not in allowed:
        hint = did_you_mean(value, map(str, allowed)) if isinstance(value, str) else ""
        raise ConfigError(f"{key}: {short(value)} is not allowed{hint}; "
                          f"choose one of {', '.join(map(repr, allowed))}")
    bounds = bounds or field.metadata.get("bounds")
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    null = ""
    if bounds is not None and bounds.none_means:
        null = f" (or null for {bounds.none_means})"
    if isinstance(value, float) and not math.isfinite(value):
        want = f" {bounds.describe()}" if bounds is not None else ""
        raise ConfigError(f"{key}: must be a finite number{want}{null}, got {short(value)}")
    if bounds is not None and not bounds.allows(value):
        raise ConfigError(f"{key}: must be {bounds.describe()}{null}, got {short(value)}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def validate(obj: Any, section: str = "", **bounds: Bounds) -> None:
    """Check every field of config dataclass ``obj`` as :func:`from_dict` would.

    Called from a section's ``__post_init__``, so that constructing it directly
    (``OptimizerConfig(lr=float("nan"))``) is checked too. Values are normalised the same
    way (an int given for a float field becomes a float).

    Args:
      obj: the dataclass instance.
      section: its dotted key (``optimizer``, ``zero.offload_param``), for messages.
      **bounds: ranges for fields that do not declare them in their metadata.
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        key = f"{section}.{f.name}" if section else f.name
        value = getattr(obj, f.name)
        checked = _coerce(value, hints[f.name], key)
        _check(f, checked, key, bounds.get(f.name))
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; keys are reported as ``prefix.key``."""
    if isinstance(data, cls):
        return data
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of {cls.__name__} keys "
                          f"(key: value lines), got {_got(data)}")
    data = dict(data or {})
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    dotted = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: str(k))
    for key in data:
        if key not in fields:
            name = dotted(key)
            raise ConfigError(
                f"unknown key {short(name)}{did_you_mean(name, [dotted(f) for f in fields])}; "
                f"valid keys: {', '.join(sorted(fields))}"
            )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], dotted(name))
        _check(fields[name], kwargs[name], dotted(name))
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in kwargs and required:
            raise ConfigError(f"{dotted(name)}: required (it has no default)")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(f"{prefix}.{e}") from None
        raise
    except (TypeError, ValueError) as e:  # a user's section rejecting a value its own way
        first = str(e).splitlines()[0] if str(e) else repr(e)
        raise ConfigError(f"{prefix or cls.__name__}: {first}") from None


def to_dict(obj: Any) -> Any:
    """Plain nested dict of a config dataclass (for printing and saving)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj
