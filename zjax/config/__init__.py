"""The experiment config: typed sections, loading from YAML or gin, dotted overrides.

This package sits at the bottom of zjax's import graph: it composes the sections, each beside
its consumer as that package's ``config.py`` (importing only ``zjax.schema``, ``zjax.errors``
and other sections), and the readers; never the engine, Orbax, Grain or Flax. A config names
its loop (``loop: lm`` or ``package.module:Name``); only that loop's ``model_config`` is looked
up here, the trainer builds the loop.
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
from zjax.config._deepspeed import from_deepspeed, read_deepspeed
from zjax.config._files import apply_overrides, as_config, load_config
from zjax.config._loop_name import BUILTIN_LOOPS, NEEDS, find_loop, model_config_of

__all__ = [
    "BUILTIN_LOOPS",
    "NEEDS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "TrainConfig",
    "apply_overrides",
    "as_config",
    "find_loop",
    "from_deepspeed",
    "load_config",
    "model_config_of",
    "read_deepspeed",
    "section_types",
]
