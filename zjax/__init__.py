"""zjax: DeepSpeed ZeRO-3 semantics for JAX/Flax.

The public names load on first use (PEP 562), so ``import zjax`` (and the ``zjax`` command
line, which needs a Ctrl-C handler in place within milliseconds) does not start JAX, Flax and
Orbax until something asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports

_EXPORTS = {
    "ArgumentError": "zjax.errors",
    "CheckpointError": "zjax.errors",
    "Config": "zjax.config",
    "ConfigError": "zjax.errors",
    "NvmeError": "zjax.errors",
    "GatherFallbackWarning": "zjax.errors",
    "LanguageModel": "zjax.task",
    "Loop": "zjax.task",
    "MeshConfig": "zjax.runtime",
    "NonFiniteError": "zjax.errors",
    "NotGatheredError": "zjax.errors",
    "PlanReport": "zjax.planning",
    "Preempted": "zjax.training",
    "ShardPlan": "zjax.partition",
    "TrainResult": "zjax.training",
    "TrainState": "zjax.step",
    "Trainable": "zjax.models",
    "TuneResult": "zjax.planning",
    "ZeroConfig": "zjax.partition",
    "ZeroStep": "zjax.step",
    "ZjaxError": "zjax.errors",
    "abstract_batch": "zjax.task",
    "autotune": "zjax.planning",
    "build_step": "zjax.task",
    "from_nnx": "zjax.models",
    "from_pytree": "zjax.models",
    "load_config": "zjax.config",
    "make_mesh": "zjax.runtime",
    "make_plan": "zjax.partition",
    "make_step": "zjax.step",
    "plan": "zjax.planning",
    "simulate_cpu_devices": "zjax.runtime",
    "train": "zjax.training",
}

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "Config",
    "ConfigError",
    "GatherFallbackWarning",
    "LanguageModel",
    "Loop",
    "MeshConfig",
    "NonFiniteError",
    "NotGatheredError",
    "NvmeError",
    "PlanReport",
    "Preempted",
    "ShardPlan",
    "TrainResult",
    "TrainState",
    "Trainable",
    "TuneResult",
    "ZeroConfig",
    "ZeroStep",
    "ZjaxError",
    "abstract_batch",
    "autotune",
    "build_step",
    "from_nnx",
    "from_pytree",
    "load_config",
    "make_mesh",
    "make_plan",
    "make_step",
    "plan",
    "simulate_cpu_devices",
    "train",
]


__getattr__ = exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from zjax.config import Config, load_config
    from zjax.errors import (
        ArgumentError,
        CheckpointError,
        ConfigError,
        GatherFallbackWarning,
        NonFiniteError,
        NotGatheredError,
        NvmeError,
        ZjaxError,
    )
    from zjax.models import Trainable, from_nnx, from_pytree
    from zjax.partition import ShardPlan, ZeroConfig, make_plan
    from zjax.planning import PlanReport, TuneResult, autotune, plan
    from zjax.runtime import MeshConfig, make_mesh, simulate_cpu_devices
    from zjax.step import TrainState, ZeroStep, make_step
    from zjax.task import LanguageModel, Loop, abstract_batch, build_step
    from zjax.training import Preempted, TrainResult, train
