"""What a configuration needs, from its shardings and shapes alone: the autotuner's pruning.

A compile is exact and, for a trillion parameters over 1,024 chips, minutes long. Building
the step is not (its abstract state and sharding plan: under a second), and fixes three
figures without compiling:

- ``floor_bytes``: device bytes every compile of it holds at its peak: the state placed in
  device memory (exact, from the shardings) and the layer inputs the forward keeps for the
  backward on the device (``L x tokens x d_model``; none when offloaded).
- ``working_bytes``: the rest, estimated: the layers gathered at once (the one in use and
  ``prefetch`` more, stage 3), one layer's gradient in the reduce dtype (every gradient
  below stage 3), and one layer's activations at work (:mod:`zjax.planning._activations`).
  The compiler's buffers differ from this sum by a factor the search measures on the
  candidates it compiles (:meth:`Estimate.factor`).
- ``wire_floor``: collective bytes per step no configuration of this stage, model axis and
  micro-batch count moves less than: the sharded gradients reduced once (every micro-batch
  from stage 2), and at stage 3 the weights gathered twice (forward, backward), in their
  dtypes.
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
    wire_floor: int

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
    # per device: the sharded leaves gathered (the stack's twice a micro-batch, forward and
    # backward; the rest once, kept for the backward) and every trained gradient reduced
    stack = sum(plan.leaf_bytes(leaf, gather, False) for leaf in plan.leaves
                if leaf.dim is not None and leaf.stacked)
    other = sum(plan.leaf_bytes(leaf, gather, False) for leaf in plan.leaves
                if leaf.dim is not None and not leaf.stacked)
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
    # quantized collectives (ZeRO++'s qwZ, qgZ) move less than the dtypes say: no floor
    wire = (0 if plan.scatter == "quantized" else grads) + (
        2 * stack + other if stage3 and not plan.zero.quantized_weights else 0)
    if plan.zero.stage >= 2:  # reduced (and gathered) every micro-batch
        wire *= config.train.grad_accum
    if plan.n_shard * plan.n_replica == 1:  # nothing to reduce over
        wire = 0
    return Estimate(floor_bytes=nbytes(zstep.abstract_state, memory="device") + kept,
                    working_bytes=int(weights + work), wire_floor=int(wire))
