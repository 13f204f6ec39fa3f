"""zjax: DeepSpeed ZeRO-3 semantics for JAX/Flax."""

from zjax.errors import CheckpointError, ConfigError, NotGatheredError, ZjaxError
from zjax.mesh import MeshConfig, make_mesh, simulate_cpu_devices
from zjax.partition import ShardPlan, ZeroConfig, make_plan
from zjax.step import TrainState, ZeroStep, make_step
from zjax.trainable import Trainable, from_nnx, from_pytree

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MeshConfig",
    "NotGatheredError",
    "ShardPlan",
    "TrainState",
    "Trainable",
    "ZeroConfig",
    "ZeroStep",
    "ZjaxError",
    "from_nnx",
    "from_pytree",
    "make_mesh",
    "make_plan",
    "make_step",
    "simulate_cpu_devices",
]
