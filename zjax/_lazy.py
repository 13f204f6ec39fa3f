"""Public names that load on first use (PEP 562), for the packages whose names pull in heavy
libraries: ``import zjax`` (and the command line, which needs its Ctrl-C handler within
milliseconds) or a config read must not start JAX, Flax, Orbax or Grain."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` whose names ``table`` maps to the modules
    defining them: the first lookup imports the module and keeps the value on the package."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__
