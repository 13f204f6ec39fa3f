"""Reading a config: YAML files (with ``base:`` inheritance) or gin files, dotted overrides."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import zjax.config._yaml as _yaml
from zjax.config._config import Config, section_types
from zjax.config._gin import locate, read_gin
from zjax.errors import ConfigError
from zjax.schema import short

__all__ = ["apply_overrides", "as_config", "load_config"]


def _parse_value(text: str, key: str) -> Any:
    """A command-line override value, read as YAML (``1e-3``, ``true``, ``null``, ``[1, 2]``)."""
    try:
        return _yaml.load(text, where=f"override {short(key)}")
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict (a copy is returned)."""
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. zero.stage=2")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value, key)
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path in seen:
        raise ConfigError(f"base: {path} includes itself through {' -> '.join(map(str, seen))}")
    try:
        data = _yaml.load(path.read_text(), where=f"config file {str(path)!r}") or {}
    except FileNotFoundError:
        named_by = f" (the base: of {str(seen[-1])!r})" if seen else ""
        raise ConfigError(f"config file {str(path)!r}{named_by} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{where}: {problem}"
            + (f" ({context})" if context else "")
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"base: expected the path of a YAML file to inherit from, got "
                          f"{short(base)} ({type(base).__name__}) in {str(path)!r}")
    parent = _read_yaml((path.parent / base).resolve(), (*seen, path))
    return _merge(parent, data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML or gin experiment file, then apply dotted overrides.

    A YAML file may name a ``base:`` file to inherit from; a ``.gin`` file binds the same
    sections (``zero.stage = 3``) and ``experiment.loop``.

    Args:
      path: ``.yaml`` / ``.gin`` file, or None for the defaults.
      overrides: ``dotted.key=value`` strings applied on top.
    """
    data: dict = {}
    bound_at: dict[str, str] = {}  # gin: where each key was bound
    if path is not None:
        path = Path(path).resolve()
        if path.suffix == ".gin":
            data, bound_at = read_gin(path, sections=list(section_types()))
        else:
            data = _read_yaml(path)
    try:
        return Config.from_dict(apply_overrides(data, overrides))
    except ConfigError as e:
        if not bound_at:
            raise
        where = locate(str(e), bound_at, {o.split("=", 1)[0].strip() for o in overrides})
        if where is None:
            raise
        raise ConfigError(f"{e} ({where})") from None


def as_config(config: Config | Mapping[str, Any] | str | os.PathLike | None, *,
              model_config: type | None = None) -> Config:
    """The :class:`Config` that ``zjax.train`` was given in any of its accepted forms.

    Args:
      config: a :class:`Config` (returned as it is); a mapping of sections, as a YAML file
        holds them (``{"train": {"steps": 50}}``), validated by the schema; a path to a YAML
        or gin file; or None for the defaults.
      model_config: for a mapping, the dataclass that validates its ``model`` section (the
        ``model_config`` of the loop being trained); default: that of the mapping's ``loop``.

    Raises:
      ConfigError: ``config`` is none of these, or does not validate.
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config, model_config=model_config)
    if config is None or isinstance(config, str | os.PathLike):
        return load_config(config)
    raise ConfigError(f"config: expected a Config, a mapping of sections or the path of a YAML "
                      f"/ gin file, got {short(config)} ({type(config).__name__})")
