"""Reading a DeepSpeed config's values: the overrides collected, keys ignored with a reason,
unknown keys refused, numbers checked as DeepSpeed's pydantic model would (see
``_deepspeed``)."""

from __future__ import annotations

import math
import re
from typing import Any

from zjax.errors import ConfigError, did_you_mean

__all__ = ["Reader", "auto", "number", "object_of"]

_NON_FINITE = re.compile(r"\s*[-+]?(NaN|Infinity|nan|inf)\b")


class Reader:
    """The overrides read so far and the keys ignored, with their reasons."""

    def __init__(self):
        self.out: dict[str, Any] = {}
        self.ignored: list[tuple[str, str]] = []

    def set(self, key: str, value: Any) -> None:
        self.out[key] = value

    def ignore(self, key: str, why: str) -> None:
        self.ignored.append((key, why))

    def unknown(self, key: str, known) -> ConfigError:
        name = key.rsplit(".", 1)[-1]
        return ConfigError(f"deepspeed {key}: unknown key{did_you_mean(name, known)}; zjax "
                           "maps every DeepSpeed key it knows (see README, From DeepSpeed)")


def auto(r: Reader, key: str, value: Any) -> bool:
    if value == "auto":
        r.ignore(key, '"auto": zjax\'s default is kept')
        return True
    return False


def number(key: str, value: Any, kind=float) -> Any:
    """``value`` as a finite float, or (``kind=int``) an integer: 2.0 is 2, 2.5 is refused."""
    # hjson reads NaN and Infinity as text to the end of the line: 'NaN,', 'NaN // why'
    if isinstance(value, str) and (m := _NON_FINITE.match(value)):
        raise ConfigError(f"deepspeed {key}: expected a finite number, got {m.group().strip()}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"deepspeed {key}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"deepspeed {key}: expected a finite number, got {value}")
    if kind is int and value != int(value):
        raise ConfigError(f"deepspeed {key}: expected an integer, got {value}")
    return kind(value)


def object_of(key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"deepspeed {key}: expected an object, got {value!r}")
    return value
