"""A task: the loop a config names (a model and its data: ``Loop``, ``LanguageModel``) and the
``ZeroStep`` built for it from a whole config (``build_step``, the one place a step is built
from a ``Config``; the engine's argument errors renamed to the config keys they came from).

It imports the data pipeline, the models, the step, the runtime and the config; never
planning, the training run, checkpoints or the command line.
"""

from zjax.task._build import CONFIG_KEYS, abstract_batch, build_step, config_keys, flops_shape
from zjax.task.loop import LanguageModel, LlamaLanguageModel, Loop, resolve_loop

__all__ = [
    "CONFIG_KEYS",
    "LanguageModel",
    "LlamaLanguageModel",
    "Loop",
    "abstract_batch",
    "build_step",
    "config_keys",
    "flops_shape",
    "resolve_loop",
]
