"""The experiment config: typed sections, loading from YAML or gin, dotted overrides.

This package sits at the bottom of zjax's import graph: it loads the section dataclasses (each
beside its consumer, in a module that imports nothing heavy) and the readers, never the engine,
Orbax, Grain or Flax. A config names its loop (``loop: lm`` or ``package.module:Name``); only
that loop's ``model_config`` is looked up here, the trainer builds the loop.
"""

from zjax.config._config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    TrainConfig,
    section_types,
)
from zjax.config._files import apply_overrides, as_config, load_config

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "TrainConfig",
    "apply_overrides",
    "as_config",
    "load_config",
    "section_types",
]
