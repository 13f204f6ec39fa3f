"""XLA:CPU running simulated devices' collectives safely: thread pool size and ordering.

Two failures of XLA:CPU (jaxlib 0.10) that a step on simulated devices must not trigger:

- a rendezvous blocks a pool thread per device, and the pool defaults to max(cores,
  devices): on a small machine a device starting a second collective leaves no thread for the
  last device, and the step hangs until XLA aborts it (``simulated_device_env`` sizes the pool;
  ``benchmarks/cpu_collectives.py`` reproduces the hang, in tens of seconds, so not here);
- collectives inside a loop are not ordered against those outside it, and every collective
  JAX emits has channel id 1: two same-kind collectives over the same devices in flight at once
  share a rendezvous key, and the run aborts (``join_gathers`` orders them by data).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from helpers import compile_on

import zjax
from zjax.models import GPT, GPTConfig, lm_loss
from zjax.partition.plan import ShardPlan
from zjax.planning import unordered_collectives
from zjax.runtime.mesh import simulated_device_env

_HLO = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %ag = f32[8] all-gather(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ag)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (w: f32[1], v: f32[8]) -> f32[8] {
  %w = f32[1] parameter(0)
  %v = f32[8] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]) tuple(%zero, %v)
  %loop = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  %out = f32[8] get-tuple-element(%loop), index=1
  %other = f32[8] all-gather(%w), channel_id=1, replica_groups=GROUPS, dimensions={0}
  %sum = f32[8] all-reduce(%out), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %r = f32[8] add(%sum, %other)
}
"""
ALL = "{{0,1,2,3,4,5,6,7}}"


def test_unordered_collectives_reads_loops_and_dependencies():
    # an all-gather outside the loop, over the same devices, depending on nothing of it
    (pair,) = unordered_collectives(_HLO.replace("GROUPS", ALL))
    assert (pair.first, pair.second, pair.kinds) == ("loop", "other", ("all_gather",))
    # other device groups: another rendezvous key, no collision
    assert unordered_collectives(_HLO.replace("GROUPS", "{{0,1,2,3},{4,5,6,7}}")) == []
    # fed by the loop's result: ordered after it
    dependent = _HLO.replace("GROUPS", ALL).replace("all-gather(%w)", "all-gather(%out)")
    assert unordered_collectives(dependent) == []
    # a control predecessor orders it as well
    control = _HLO.replace("GROUPS", ALL).replace(
        "dimensions={0}\n  %sum", "dimensions={0}, control-predecessors={%loop}\n  %sum")
    assert unordered_collectives(control) == []


def _untied_step():
    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=128,
                    max_seq_len=32, tie_embeddings=False)
    trainable = zjax.from_nnx(lambda rngs: GPT(cfg, rngs=rngs), lm_loss)
    zero = zjax.ZeroConfig(stage=3, gather_dtype="bfloat16", prefetch_layers=2)
    zstep = zjax.make_step(trainable, optax.adamw(1e-3), zero=zero, mesh=zjax.make_mesh())
    from jax import ShapeDtypeStruct

    return compile_on(zstep.lower(ShapeDtypeStruct((16, 33), jnp.int32))).as_text()


def test_joined_gathers_order_the_stack_loops(monkeypatch):
    """An untied head at prefetch 2: its gather runs beside the forward layer loop's gathers
    unless the non-stack gathers are joined (as the plan does on CPU)."""
    assert unordered_collectives(_untied_step()) == []
    monkeypatch.setattr(ShardPlan, "join_gathers", property(lambda self: False))
    kinds = {kind for pair in unordered_collectives(_untied_step()) for kind in pair.kinds}
    assert "all_gather" in kinds


def test_simulated_device_env_sizes_the_thread_pool():
    env = simulated_device_env(8, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --x=1"})
    assert env["XLA_FLAGS"] == "--x=1 --xla_force_host_platform_device_count=8"
    assert int(env["PJRT_NPROC"]) >= 4 * 8
    assert "PJRT_NPROC" not in simulated_device_env(8, {"PJRT_NPROC": "12"})  # the user's
