"""What a configuration needs, from its shardings and shapes alone: the autotuner's pruning.

A compile is exact and, for a trillion parameters over 1,024 chips, minutes long. Building
the step is not (its abstract state and sharding plan: under a second), and gives these
figures without compiling:

- ``floor_bytes``: device bytes every compile of it holds at its peak: the state placed in
  device memory (exact, from the shardings) and the layer inputs the forward keeps for the
  backward on the device (``L x tokens x d_model``; none when offloaded).
- ``working_bytes``: the rest, estimated: the layers gathered at once (the one in use and
  ``prefetch`` more, stage 3), one layer's gradient in the reduce dtype (every gradient
  below stage 3), and one layer's activations at work (:mod:`zjax.planning._activations`).
  The compiler's buffers differ from this sum by a factor the search measures on the
  candidates it compiles (:meth:`Estimate.factor`).
- ``state_bytes``: the device state alone, which with the temporaries a compiler's refusal
  names (libtpu) gives the total it refused.
"""

from __future__ import annotations

import dataclasses

from zjax.config import Config
from zjax.partition import nbytes
from zjax.planning._activations import estimate as activation_estimate

__all__ = ["Estimate", "estimate_config"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A configuration's figures without its compile (see the module docstring)."""

    floor_bytes: int
    working_bytes: int
    state_bytes: int  # of floor_bytes: the state in device memory (a compile's arguments)

    def predicted(self, factor: float) -> int:
        """The device total with the working set scaled by a compile-measured ``factor``."""
        return self.floor_bytes + round(factor * self.working_bytes)

    def factor(self, total_bytes: int) -> float:
        """The factor that makes :meth:`predicted` equal a compiled ``total_bytes``."""
        return (total_bytes - self.floor_bytes) / max(1, self.working_bytes)


def _layers(config: Config) -> int:
    return max(1, getattr(config.model, "n_layers", 1))


def estimate_config(config: Config, devices: list) -> Estimate:
    """``config``'s :class:`Estimate` on ``devices`` (its step built, nothing lowered);
    raises what building it raises (a ConfigError for a configuration that cannot be
    built)."""
    from zjax.task import build_step, config_keys
    from zjax.task.loop import resolve_loop

    with config_keys():
        zstep = build_step(config, devices, loop=resolve_loop(config.loop))
    plan = zstep.plan
    gather, reduce = plan.zero.gather, plan.reduce_dtype
    stage3 = plan.zero.stage >= 3
    layers = _layers(config)
    # per device: the layer stack's sharded leaves gathered, every trained gradient
    stack = sum(plan.leaf_bytes(leaf, gather, False) for leaf in plan.leaves
                if leaf.dim is not None and leaf.stacked)
    grads = sum(plan.leaf_bytes(leaf, reduce, False) for leaf in plan.leaves if not leaf.frozen)
    acts = activation_estimate(config.model, config.data, config.train, config.zero,
                               n_batch=plan.n_batch, n_model=plan.n_model,
                               n_context=plan.n_context, act_bytes=gather.itemsize,
                               platform=plan.mesh.devices.flat[0].platform)
    kept = acts.get("saved_inputs_bytes", 0)
    if acts and not stage3 and getattr(config.model, "remat", True) is False:
        kept = 0  # without remat the estimate counts every activation: not a sure floor
    if stage3:
        depth = plan.zero.prefetch_depth(layer_elements=stack // gather.itemsize // layers,
                                         n_layers=layers)
        weights = ((1 + depth) * stack + grads) // layers
    else:  # the whole gradient (in the reduce dtype) before its reduction
        weights = grads
    work = sum(acts.get(k, 0) for k in ("attention_bytes", "mlp_bytes", "loss_bytes"))
    state = nbytes(zstep.abstract_state, memory="device")
    return Estimate(floor_bytes=state + kept, working_bytes=int(weights + work),
                    state_bytes=state)
