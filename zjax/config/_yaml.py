"""YAML for experiment files and overrides: safe tags only, no duplicate keys, bounded aliases.

``yaml.safe_load`` already refuses ``!!python`` tags. On top of it, a key given twice in one
mapping is an error (rather than the last one silently winning), and a document whose aliases
(``&anchor`` / ``*alias``) would expand to more than :data:`MAX_VALUES` values, or into a
cycle, is refused: aliases share one object, but anything that walks or prints the value
(a deep copy, an error message) pays for every copy ("billion laughs").
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

from zjax.errors import ConfigError
from zjax.schema import short

__all__ = ["MAX_VALUES", "check_expansion", "load"]

MAX_VALUES = 100_000  # a real experiment file holds a few hundred
_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *base` keys may be overridden on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # unhashable: SafeConstructor says so itself
                continue
            if first is not key_node:
                raise ConstructorError(
                    problem=f"duplicate key {short(key)} (first given at line "
                            f"{first.start_mark.line + 1})",
                    problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def check_expansion(value: Any, where: str, limit: int = MAX_VALUES) -> None:
    """Refuse a value that expands (every alias copied) to more than ``limit`` values, or
    that contains itself.

    Shared parts are counted once per use but visited once, so this takes time linear in
    the loaded document, not in its expansion.

    Args:
      value: a loaded YAML (or gin) value.
      where: what it came from, for the message (``config file 'x.yaml'``).
      limit: the largest expanded size allowed (a string counts one per 100 characters).
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(v: Any) -> int:
        if not isinstance(v, dict | list | tuple):
            return 1 + (len(v) // 100 if isinstance(v, str) else 0)
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in active:
            raise ConfigError(f"{where}: a value contains itself (a YAML alias to one of its "
                              "own parents); refusing it")
        active.add(id(v))
        n = 1
        for item in (*v.keys(), *v.values()) if isinstance(v, dict) else v:
            n += size(item)
            if n > limit:
                raise ConfigError(f"{where}: expands to more than {limit} values through "
                                  "repeated aliases (&anchor / *alias) or macros; refusing it")
        active.discard(id(v))
        sizes[id(v)] = n
        return n

    try:
        size(value)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None


def load(text: str, where: str) -> Any:
    """Parse YAML ``text`` (see the module docstring for what is refused).

    Raises:
      yaml.YAMLError: the text is not valid YAML, or a mapping repeats a key.
      ConfigError: it nests too deeply, or its aliases expand too far.
    """
    try:
        value = yaml.load(text, Loader=_Loader)  # a SafeLoader: no python tags
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    check_expansion(value, where)
    return value
