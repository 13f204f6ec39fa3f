"""Typed config sections from plain dicts: the one place where key and type checks happen.

A section is a frozen dataclass. ``from_dict`` builds one from a mapping, rejecting unknown keys
(with a "did you mean"), values of the wrong type, and values outside a field's ``choices``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from zjax.errors import ConfigError, did_you_mean

__all__ = ["choices", "from_dict", "to_dict"]

T = TypeVar("T")


def choices(*allowed: Any, default: Any) -> Any:
    """A dataclass field whose value must be one of ``allowed``."""
    return dataclasses.field(default=default, metadata={"choices": allowed})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {names}, got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp in (int, float) and isinstance(value, str):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 1e-3 as a string
            value = float(value) if tp is float else int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is int:
        if isinstance(value, float) and value.is_integer():  # 1e5 in YAML is a float
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r} ({type(value).__name__})")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(
                f"{key}: expected {tp.__name__}, got {value!r} ({type(value).__name__})"
            )
        return value
    return value


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; keys are reported as ``prefix.key``."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    dotted = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: k)
    for key in data:
        if key not in fields:
            raise ConfigError(
                f"unknown key {dotted(key)!r}"
                f"{did_you_mean(dotted(key), [dotted(f) for f in fields])}; "
                f"valid keys: {', '.join(sorted(fields))}"
            )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], dotted(name))
        allowed = fields[name].metadata.get("choices")
        if allowed is not None and kwargs[name] not in allowed:
            raise ConfigError(
                f"{dotted(name)}: {value!r} is not allowed"
                f"{did_you_mean(value, map(str, allowed))}; "
                f"choose one of {', '.join(map(repr, allowed))}"
            )
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(f"{prefix}.{e}") from None
        raise


def to_dict(obj: Any) -> Any:
    """Plain nested dict of a config dataclass (for printing and saving)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj
