"""zjax: DeepSpeed ZeRO-3 semantics for JAX/Flax."""

from zjax._autotune import TuneResult
from zjax._planning import PlanReport
from zjax._preempt import Preempted
from zjax.config import Config, load_config
from zjax.errors import CheckpointError, ConfigError, NotGatheredError, ZjaxError
from zjax.loop import LanguageModel, Loop
from zjax.mesh import MeshConfig, make_mesh, simulate_cpu_devices
from zjax.partition import ShardPlan, ZeroConfig, make_plan
from zjax.planner import autotune, plan
from zjax.step import TrainState, ZeroStep, make_step
from zjax.trainable import Trainable, from_nnx, from_pytree
from zjax.trainer import TrainResult, train

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "LanguageModel",
    "Loop",
    "MeshConfig",
    "NotGatheredError",
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
    "autotune",
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
