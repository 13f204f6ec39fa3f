"""What a config's ``loop:`` names, found without building it.

``lm`` is the built-in language-model loop; ``package.module:Name`` imports that module and
takes ``Name``. Reading a config needs only the loop's ``model_config`` (the dataclass that
validates the ``model`` section), so this module loads nothing heavy for ``lm`` and never
instantiates a user's loop: the trainer and the CLI do that (:func:`zjax.task.loop.resolve_loop`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from zjax.errors import ConfigError, did_you_mean, first_line
from zjax.models.config import GPTConfig, LlamaConfig
from zjax.schema import short

__all__ = ["BUILTIN_LOOPS", "NEEDS", "find_loop", "model_config_of"]

# name -> (where the loop is, its model_config): the model config without importing the loop
BUILTIN_LOOPS: dict[str, tuple[str, type]] = {
    "lm": ("zjax.task.loop:LanguageModel", GPTConfig),
    "llama": ("zjax.task.loop:LlamaLanguageModel", LlamaConfig),
}
NEEDS = "it needs model_config (a dataclass), trainable() and data()"


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise ConfigError(f"loop: expected a name like 'lm' or 'pkg.mod:Name', got "
                          f"{short(name)} ({type(name).__name__})")
    if name not in BUILTIN_LOOPS and ":" not in name:
        raise ConfigError(
            f"loop: {short(name)} is not a built-in loop{did_you_mean(name, BUILTIN_LOOPS)}; "
            f"use one of {', '.join(BUILTIN_LOOPS)} or 'package.module:ClassName'"
        )


def find_loop(name: str) -> Any:
    """The class (or object) ``name`` points at, checked to have a Loop's attributes.

    Imports the named module (running its code), but instantiates nothing: ``loop:
    subprocess:Popen`` is refused before anything runs.

    Raises:
      ConfigError: naming ``loop`` and what is wrong with the name.
    """
    _check_name(name)
    module_name, _, attr = BUILTIN_LOOPS.get(name, (name,))[0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises on import: one line
        why = first_line(e) or type(e).__name__
        raise ConfigError(f"loop: cannot import module {module_name!r} ({why})") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ConfigError(
            f"loop: module {module_name!r} has no {attr!r}{did_you_mean(attr, names)}"
        ) from None
    missing = [a for a in ("model_config", "trainable", "data") if not hasattr(found, a)]
    if missing:
        raise ConfigError(f"loop: {short(name)} is not a Loop ({NEEDS}; it has no "
                          f"{', '.join(missing)})")
    if not dataclasses.is_dataclass(found.model_config):
        raise ConfigError(f"loop: {short(name)} is not a Loop ({NEEDS})")
    return found


def model_config_of(name: str) -> type:
    """The dataclass that validates the ``model`` section of loop ``name``."""
    _check_name(name)
    if name in BUILTIN_LOOPS:
        return BUILTIN_LOOPS[name][1]
    return find_loop(name).model_config
