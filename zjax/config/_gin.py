"""Gin experiment files: gin syntax for the same sections the YAML schema validates.

A gin file binds ``section.key = value`` (``zero.stage = 3``, ``zero.offload_param.device =
'host'``), plus ``experiment.loop = 'lm'`` to pick the loop; ``NAME = value`` defines a macro
used as ``%NAME``, ``include 'other.gin'`` reads another file (relative to the including one,
then to the working directory) and ``import module`` imports a module. The result is the same
nested dict a YAML file gives, so types, ranges and overrides are checked by the one schema.

Only gin's parser is used: nothing is bound in gin's global registry, so a program that embeds
zjax keeps its own gin bindings.
"""

from __future__ import annotations

import importlib
import re
import tokenize
from pathlib import Path
from typing import Any, NamedTuple

from gin import config_parser

from zjax.config._yaml import check_expansion
from zjax.errors import ConfigError, did_you_mean

__all__ = ["locate", "read_gin"]


class _Macro(NamedTuple):
    name: str


class _Reference(NamedTuple):
    name: str


class _Delegate(config_parser.ParserDelegate):
    """Stands in for macros and ``@references``; they are resolved (or refused) later."""

    def configurable_reference(self, scoped_configurable_name: str, evaluate: bool) -> Any:
        return _Reference(scoped_configurable_name)

    def macro(self, macro_name: str) -> Any:
        return _Macro(macro_name)


class _Reader:
    """The bindings, macros and locations of a gin file and the files it includes."""

    def __init__(self, path: Path, sections: list[str]):
        self.path, self.sections = path, sections
        self.bindings: dict[str, tuple[Any, str]] = {}  # dotted key -> (value, where)
        self.macros: dict[str, tuple[Any, str]] = {}

    def read(self, path: Path, stack: tuple[Path, ...] = ()) -> None:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"gin file {str(path)!r} cannot be read: {e}") from None
        try:
            for statement in config_parser.ConfigParser(text, _Delegate()):
                self._statement(statement, path, (*stack, path))
        except (SyntaxError, ValueError, tokenize.TokenError) as e:
            if isinstance(e, ConfigError):
                raise
            if isinstance(e, tokenize.TokenError):  # args: (message, (line, column))
                msg, line = e.args[0], e.args[1][0]
            else:
                msg = getattr(e, "msg", None) or (str(e).splitlines() or [type(e).__name__])[0]
                line = getattr(e, "lineno", None)
            where = f", line {line}" if line else ""
            raise ConfigError(f"gin file {str(path)!r}{where}: {msg}") from None

    def _statement(self, st: Any, path: Path, stack: tuple[Path, ...]) -> None:
        where = f"gin file {str(path)!r}, line {st.location.line_num}"
        if isinstance(st, config_parser.IncludeStatement):
            target = _include_path(st.filename, path, where)
            if target in stack:
                chain = " -> ".join(str(p) for p in (*stack, target))
                raise ConfigError(f"{where}: include {st.filename!r} includes a file that is "
                                  f"already being read ({chain})")
            self.read(target, stack)
        elif isinstance(st, config_parser.ImportStatement):
            try:
                importlib.import_module(st.module)
            except Exception as e:  # whatever a module raises on import: one line
                first = (str(e).splitlines() or [type(e).__name__])[0]
                raise ConfigError(f"{where}: {st.format()}: {first}") from None
        elif isinstance(st, config_parser.BlockDeclaration):
            self._key(st.scope, st.selector, "", where)
        elif isinstance(st, config_parser.BindingStatement):
            if not st.arg_name:  # NAME = value: a macro
                if st.scope:
                    raise ConfigError(f"{where}: scoped macros ({st.scope}/{st.selector}) are "
                                      "not supported")
                self.macros[st.selector] = (st.value, where)
            else:
                key = self._key(st.scope, st.selector, st.arg_name, where)
                self.bindings[key] = (st.value, f"{where}: {st.selector}.{st.arg_name}")

    def _key(self, scope: str, selector: str, arg: str, where: str) -> str:
        """``zero.offload_param`` + ``device`` -> ``zero.offload_param.device``; ``experiment``
        + ``loop`` -> ``loop``."""
        if scope:
            raise ConfigError(f"{where}: scopes ({scope}/{selector}) are not supported in "
                              "zjax experiment files")
        selector = selector.removeprefix("zjax.")
        section = selector.split(".")[0]
        if section not in (*self.sections, "experiment"):
            names = [*self.sections, "experiment"]
            raise ConfigError(
                f"{where}: No configurable matching {section!r}.{did_you_mean(section, names)}"
                f"; configurables: {', '.join(names)}")
        if section == "experiment":
            if selector != "experiment" or arg not in ("loop", ""):
                raise ConfigError(f"{where}: unknown key {selector}.{arg}; experiment binds "
                                  "only loop")
            return "loop"
        return f"{selector}.{arg}" if arg else selector

    def result(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The nested dict, and where each dotted key was bound."""
        out: dict[str, Any] = {}
        resolved: dict[str, Any] = {}
        for key, (value, where) in self.bindings.items():
            node = out
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{where}: {key}: {part!r} is bound to a value, not a "
                                      "section")
            node[last] = self._resolve(value, where, resolved, ())
        check_expansion(out, f"gin file {str(self.path)!r}")
        return out, {key: where for key, (_, where) in self.bindings.items()}

    def _resolve(self, value: Any, where: str, resolved: dict[str, Any],
                 active: tuple[str, ...]) -> Any:
        if isinstance(value, _Reference):
            raise ConfigError(f"{where}: @{value.name}: configurable references are not "
                              "supported in zjax experiment files; give the value itself")
        if isinstance(value, _Macro):
            name = value.name
            if name in active:
                raise ConfigError(f"{where}: macro %{name} refers to itself "
                                  f"({' -> '.join((*active, name))})")
            if name not in resolved:
                if name not in self.macros:
                    raise ConfigError(f"{where}: undefined macro %{name}"
                                      f"{did_you_mean(name, self.macros)}; define it with "
                                      f"`{name} = value`")
                body, body_where = self.macros[name]
                resolved[name] = self._resolve(body, body_where, resolved, (*active, name))
            return resolved[name]  # shared, not copied: check_expansion bounds the total
        if isinstance(value, list | tuple):
            return type(value)(self._resolve(v, where, resolved, active) for v in value)
        if isinstance(value, dict):
            return {self._resolve(k, where, resolved, active):
                    self._resolve(v, where, resolved, active) for k, v in value.items()}
        return value


def _include_path(name: str, including: Path, where: str) -> Path:
    for candidate in (including.parent / name, Path(name)):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"{where}: include {name!r}: no such file (looked in "
                      f"{str(including.parent)!r} and the working directory)")


def read_gin(path: Path, *, sections: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a gin experiment file into the nested dict the config schema validates.

    Args:
      path: the ``.gin`` file.
      sections: the config's section names (what a binding's first part may be).

    Returns:
      ``(data, where)``: the nested dict, and for each dotted key the file and line that
      bound it (for :func:`locate`).
    """
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    reader = _Reader(path, sections)
    reader.read(path.resolve())
    return reader.result()


def locate(message: str, where: dict[str, str], overridden: set[str]) -> str | None:
    """The gin binding a schema error is about (``gin file 'x.gin', line 3``), if any.

    Args:
      message: the error, which starts with its dotted key (``zero.stage: ...``,
        ``unknown key 'zero.stgae' ...``).
      where: dotted key -> where it was bound, from :func:`read_gin`.
      overridden: dotted keys given as command-line overrides (those are not the file's).
    """
    m = re.match(r"(?:unknown key ')?([\w.]+)", message)
    if not m:
        return None
    key = m.group(1)
    for bound in sorted(where, key=len, reverse=True):
        if (key == bound or key.startswith(bound + ".")) and not any(
                key == o or key.startswith(o + ".") for o in overridden):
            return where[bound]
    return None
