"""Gin experiment files: gin binds the same section dataclasses the YAML schema uses.

A gin file binds ``section.key = value`` (``zero.stage = 3``, ``train.steps = 200``), plus
``experiment.loop = 'lm'`` to pick the loop. The result is the same nested dict a YAML file
gives, so validation and overrides are shared.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import gin

from zjax._schema import to_dict
from zjax.errors import ConfigError, did_you_mean

__all__ = ["read_gin"]


def _experiment(loop: str = "lm") -> dict:
    return {"loop": loop}


def _parse(path: Path, model_cls: type, *, skip_unknown: bool) -> dict[str, Any]:
    from zjax.config import section_types

    sections = section_types(model_cls)
    gin.clear_config(clear_constants=True)
    gin.enter_interactive_mode()  # allow re-registering the configurables on every load
    try:
        makers = {name: gin.external_configurable(cls, name=name, module="zjax")
                  for name, cls in sections.items()}
        experiment = gin.external_configurable(_experiment, name="experiment", module="zjax")
        try:
            gin.parse_config_file(str(path), skip_unknown=skip_unknown)
        except (ValueError, KeyError, SyntaxError) as e:
            raise _gin_error(path, e, sections) from None
        out: dict[str, Any] = dict(experiment())
        for name, make in makers.items():
            out[name] = to_dict(make())
        return out
    finally:
        gin.clear_config(clear_constants=True)
        gin.exit_interactive_mode()


def _gin_error(path: Path, e: Exception, sections: dict[str, type]) -> ConfigError:
    names = [*sections, "experiment"]
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    m = re.search(r"No configurable matching '([^']+)'", text)
    hint = ""
    if m:
        hint = did_you_mean(m.group(1), names) + f"; configurables: {', '.join(names)}"
    m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
    if m:
        section, key = m.group(1).split(".")[-1], m.group(2)
        fields = [f.name for f in dataclasses.fields(sections[section])] if section in sections \
            else ["loop"]
        hint = f" (unknown key {section}.{key}{did_you_mean(key, fields)})"
    return ConfigError(f"gin file {str(path)!r}: {text}{hint}")


def read_gin(path: Path) -> dict[str, Any]:
    """Read a gin experiment file into the nested dict the config schema validates."""
    from zjax.loop import resolve_loop
    from zjax.models.gpt import GPTConfig

    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    # first pass: which loop (its model section's dataclass decides the model bindings)
    loop = _parse(path, GPTConfig, skip_unknown=True)["loop"]
    model_cls = resolve_loop(loop).model_config
    return _parse(path, model_cls, skip_unknown=False)
