"""The rollout phase of an RL run (``rl.method``) in ``zjax plan``: the generation program
(:attr:`zjax.step.ZeroStep.rollout`) lowered from ``ShapeDtypeStruct``s for one rollout
batch and compiled like the train step, its memory beside the step's.

During a rollout the whole training state stays where it is (params, float32 master,
optimizer state) and the program adds the model gathered once in ``zero.gather_dtype``, the
key/value cache of the device's rows and the logits: the phase's peak is the state's device
bytes plus the program's temporaries and output (its arguments are the state's params).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zjax.partition import nbytes
from zjax.planning._hlo import collective_bytes
from zjax.planning._memory import compiled_memory, format_bytes
from zjax.runtime import compile_for_figures
from zjax.step import ZeroStep

__all__ = ["rollout_figures", "rollout_lines"]


def _lowered(zstep: ZeroStep, rl: Any, rows: int, width: int):
    a = zstep.abstract_state
    split = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=zstep.batch_sharding)
    key = jax.eval_shape(lambda: jax.random.key(0))
    stop = jax.ShapeDtypeStruct((2,), jnp.int32)  # an end-of-turn id and the EOS
    return zstep.rollout.lower(a.params, a.frozen, split((rows, width)), split((rows,)), key,
                               stop, rl.max_new_tokens, float(rl.temperature), float(rl.top_p))


def rollout_figures(zstep: ZeroStep, rl: Any, data: Any, devices: list, *,
                    compile_only: bool, capacity: int | None) -> dict[str, Any]:
    """Per device, the rollout phase of ``rl`` (the ``rl`` section) on ``data``'s batches.

    Returns:
      ``rows`` (completions generated at once: ``data.batch_size`` x
      ``rl.steps_per_generation``), ``prompt_tokens`` (``data.prompt_limit``),
      ``new_tokens``, ``gathered_bytes`` (the model's params in ``zero.gather_dtype``, held
      whole on every device), ``temp_bytes`` and ``output_bytes`` (the compiled program's),
      ``state_bytes`` (the training state in device memory, there throughout),
      ``total_bytes`` (their sum: the phase's peak), ``all_gather_bytes`` (read off the
      compiled program: the model once, not once per token) and ``fits_device`` (None
      without a ``capacity``). Empty without a rollout (a model with no decoder).
    """
    if zstep.rollout is None:
        return {}
    rows = data.batch_size * rl.steps_per_generation
    compiled = compile_for_figures(_lowered(zstep, rl, rows, data.prompt_limit), devices,
                                   compile_only=compile_only)
    mem = compiled_memory(compiled)
    plan = zstep.plan
    coll = collective_bytes(compiled.as_text(), mesh_axes=dict(plan.mesh.shape),
                            decomposed=plan.backend.decomposes_collectives)
    gather = jnp.dtype(plan.zero.gather).itemsize
    # a preference-style reference copy (derived_frozen) is stored, never decoded
    gathered = sum(leaf.size * (gather if jnp.issubdtype(leaf.dtype, jnp.floating)
                                else jnp.dtype(leaf.dtype).itemsize)
                   for leaf in plan.leaves if not (leaf.frozen and zstep.derived_frozen))
    state = nbytes(zstep.abstract_state, memory="device")
    total = state + mem["temp_bytes"] + mem["output_bytes"]
    return {"rows": rows, "prompt_tokens": data.prompt_limit, "new_tokens": rl.max_new_tokens,
            "gathered_bytes": int(gathered), "temp_bytes": mem["temp_bytes"],
            "output_bytes": mem["output_bytes"], "state_bytes": state, "total_bytes": total,
            "all_gather_bytes": coll.all_gather + coll.all_gather_via_all_reduce,
            "fits_device": None if capacity is None else total <= capacity}


def rollout_lines(r: dict[str, Any]) -> list[str]:
    """An RL run's rollout phase, below the training step's memory."""
    if not r:
        return []
    fits = {None: "", True: "  fits", False: "  DOES NOT FIT"}[r["fits_device"]]
    return [f"  rollout phase ({r['rows']} completions of {r['prompt_tokens']} + "
            f"{r['new_tokens']} tokens, the model gathered once)",
            f"    {'model, gathered':<20}{'':>14}{format_bytes(r['gathered_bytes']):>14}",
            f"    {'generation temp':<20}{format_bytes(r['temp_bytes']):>14}",
            f"    {'state on device':<20}{format_bytes(r['state_bytes']):>14}",
            f"    {'total on device':<20}{format_bytes(r['total_bytes']):>14}{fits}",
            f"    all-gather {format_bytes(r['all_gather_bytes'])} per rollout"]
