"""Fast guards of the data-safety machinery: non-finite steps, leaf digests, the run directory
lock, torn metrics lines, preemption messages."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FP32, assert_trees_close, reference_run

import zjax
from zjax.checkpoint._digest import array_digest, tree_digests
from zjax.errors import ConfigError, NonFiniteError
from zjax.offload import OffloadConfig, OptimizerOffloadConfig
from zjax.partition import ZeroConfig
from zjax.training._metrics import read_metrics
from zjax.training._nonfinite import FiniteWatch
from zjax.training._preempt import Preempted
from zjax.training._rundir import RunDir


def _trainable():
    def init(rng):
        k1, k2 = jax.random.split(rng)
        return {"w": jax.random.normal(k1, (64, 16)) * 0.1, "b": jax.random.normal(k2, (16,))}

    def loss(params, batch):
        y = jnp.tanh(batch @ params["w"] + params["b"])
        return jnp.sum(y ** 2), jnp.asarray(y.size, jnp.float32)

    return init, loss


def _batches(n):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(16, 64)).astype(np.float32) for _ in range(n)]


_BOTH_ON_HOST = dict(offload_optimizer=OptimizerOffloadConfig(device="host", update_on="host"),
                    offload_param=OffloadConfig(device="host"))


@pytest.mark.parametrize(("stage", "micro_batches", "offload"), [
    (1, 1, {}), (3, 1, {}), (3, 2, {}), (3, 1, _BOTH_ON_HOST),
])
def test_skip_drops_exactly_the_nonfinite_updates(stage, micro_batches, offload):
    """With on_nonfinite: skip a NaN batch leaves params and optimizer state untouched: the run
    equals single-device optax over the finite batches only (also accumulating micro-batches,
    and with params and optimizer state in host memory, updated on the host)."""
    init, loss = _trainable()
    tx = optax.adam(1e-2, eps=1e-5)
    batches = _batches(5)
    poisoned = [*batches[:2], np.full_like(batches[0], np.nan), *batches[2:]]
    zstep = zjax.make_step(zjax.from_pytree(init, loss), tx, mesh=zjax.make_mesh(),
                           zero=ZeroConfig(stage=stage, param_persistence_threshold=0,
                                           gather_dtype="float32", **offload),
                           skip_nonfinite=True, micro_batches=micro_batches)
    state = zstep.init(jax.random.key(0))
    flags = []
    for b in poisoned:
        state, metrics = zstep.step(state, zstep.put_batch(b))
        flags.append(bool(metrics["finite"]))
    assert flags == [True, True, False, True, True, True]
    ref_params, ref_opt, _ = reference_run(init, loss, tx, batches)
    params = state.master if state.master is not None else state.params
    assert_trees_close(params, ref_params, **FP32, what="params")
    assert_trees_close(state.opt_state, ref_opt, **FP32, what="opt_state")


def test_without_skip_a_nonfinite_update_is_reported():
    init, loss = _trainable()
    zstep = zjax.make_step(zjax.from_pytree(init, loss), optax.adam(1e-2), mesh=zjax.make_mesh(),
                           zero=ZeroConfig(stage=3, param_persistence_threshold=0))
    state = zstep.init(jax.random.key(0))
    state, m = zstep.step(state, zstep.put_batch(_batches(1)[0]))
    assert bool(m["finite"]) and np.isfinite(float(m["param_norm"]))
    state, m = zstep.step(state, zstep.put_batch(np.full((16, 64), np.inf, np.float32)))
    assert not bool(m["finite"])


def _metrics(finite: bool, loss=1.0):
    return {"finite": jnp.asarray(finite), "loss": jnp.asarray(loss if finite else np.nan),
            "grad_norm": jnp.asarray(1.0), "param_norm": jnp.asarray(2.0)}


def test_watch_stop_names_the_first_nonfinite_step():
    watch = FiniteWatch("stop", max_skips=3)
    for step, ok in [(1, True), (2, True), (3, False), (4, False)]:
        watch.add(step, _metrics(ok))
    with pytest.raises(NonFiniteError, match=r"step 3 is not finite \(loss nan"):
        watch.poll(wait=True)


def test_watch_skip_counts_and_stops_after_max_skips_in_a_row():
    watch = FiniteWatch("skip", max_skips=2)
    for step, ok in enumerate([False, False, True, False, False], 1):
        watch.add(step, _metrics(ok))
    watch.poll(wait=True)
    assert (watch.skipped, watch.in_a_row) == (4, 2)
    watch.add(6, _metrics(False))
    with pytest.raises(NonFiniteError, match=r"train.max_skips: 3 steps in a row up to step 6"):
        watch.poll(wait=True)


def test_digest_is_sharding_independent_and_sees_one_flipped_bit():
    x = np.random.default_rng(0).normal(size=(32, 24)).astype(np.float32)
    mesh = zjax.make_mesh()
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        "data")))
    assert tree_digests({"x": sharded})["x"] == array_digest(x)
    for word, bit in [(0, 0), (377, 31), (767, 13)]:
        y = x.copy()
        y.reshape(-1).view(np.uint32)[word] ^= np.uint32(1 << bit)
        assert array_digest(y) != array_digest(x)
    assert array_digest(x[::-1].copy()) != array_digest(x)  # positions count, not just values
    # chunked (bounded memory) equals whole, for 4- and 8-byte elements and a ragged last chunk
    for a in (x, x.astype(np.float64), x.astype(np.float16)):
        assert array_digest(a, chunk=100) == array_digest(a, chunk=a.size)
    assert tree_digests({"x": jax.numpy.asarray(x.astype(np.float16))})["x"] == array_digest(
        x.astype(np.float16), chunk=50)


def test_torn_last_metrics_line_is_skipped_but_a_damaged_middle_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    with RunDir(tmp_path) as run:
        run.truncate_metrics(1)
    assert path.read_text() == json.dumps({"step": 1, "loss": 2.0}) + "\n"
    path.write_text('{"step": 1, "lo\n' + json.dumps({"step": 2, "loss": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        read_metrics(tmp_path)


LOCK_HOLDER = textwrap.dedent("""
    import sys, time
    from zjax.training._rundir import RunDir
    run = RunDir(sys.argv[1])
    print("locked", flush=True)
    time.sleep(60)
""")


def test_run_directory_is_locked_while_a_trainer_holds_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"in use by another trainer \(pid {holder.pid}"):
            RunDir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    with RunDir(tmp_path):  # the dead holder's lock went with it: no stale lock
        pass


def test_preempted_message_tells_what_was_saved():
    assert "checkpoint of step 12 saved in /r/checkpoints" in str(
        Preempted(12, signal.SIGTERM, "/r/checkpoints", 12))
    assert "no checkpoint was saved" in str(Preempted(3, signal.SIGINT, "/r", None))


def test_digest_sees_two_bit_flips_at_power_of_two_strides():
    x = np.random.default_rng(1).normal(size=(1 << 21,)).astype(np.float32)
    base = array_digest(x)
    for stride in (1, 1 << 14, 1 << 20):
        for bit in (0, 18, 31):
            y = x.copy()
            words = y.view(np.uint32)
            words[7] ^= np.uint32(1 << bit)
            words[7 + stride] ^= np.uint32(1 << bit)
            assert array_digest(y) != base, (stride, bit)
    y = x.copy()
    y[7], y[7 ^ (1 << 20)] = -y[7], -y[7 ^ (1 << 20)]  # two sign flips
    assert array_digest(y) != base


def test_lockstep_watch_reads_each_flag_one_step_late():
    watch = FiniteWatch("stop", max_skips=0, lockstep=True)
    watch.add(1, _metrics(True))
    watch.poll()
    assert len(watch.pending) == 1  # the newest stays in flight
    watch.add(2, _metrics(False))
    watch.poll()  # reads step 1 only
    watch.add(3, _metrics(True))
    with pytest.raises(NonFiniteError, match="step 2 is not finite"):
        watch.poll()


@pytest.mark.parametrize(("error", "damage"), [
    (FileNotFoundError("gone"), True),
    (ValueError('OUT_OF_RANGE: Error reading "x" in OCDBT database'), True),
    (json.JSONDecodeError("bad", "{", 0), True),
    (PermissionError(13, "Permission denied"), False),  # the filesystem's, not the data's
    (OSError(5, "Input/output error"), False),
    (TypeError("a bug"), False),
    (ValueError("shapes do not match"), False),
])
def test_only_unreadable_data_counts_as_damage(error, damage):
    from zjax.errors import is_damage

    wrapped = Exception("Encountered error while reading array index")
    wrapped.__cause__ = error  # as Orbax wraps Tensorstore's error
    assert is_damage(error) is damage and is_damage(wrapped) is damage


def _stage3_with_checkpointer(tmp_path):
    """A stage-3 step of the small trainable and a synchronous checkpointer under tmp_path."""
    from zjax.checkpoint import CheckpointConfig, Checkpointer

    init, loss = _trainable()
    zstep = zjax.make_step(zjax.from_pytree(init, loss), optax.adam(1e-2), mesh=zjax.make_mesh(),
                           zero=ZeroConfig(stage=3, param_persistence_threshold=0))
    return zstep, Checkpointer(tmp_path / "checkpoints", CheckpointConfig(asynchronous=False))


def test_an_error_that_is_not_damage_surfaces_and_nothing_moves(tmp_path, monkeypatch):
    zstep, ckpt = _stage3_with_checkpointer(tmp_path)
    ckpt.save(1, zstep.init(jax.random.key(0)), zstep)
    ckpt.wait()
    restored = ckpt.restore_latest(zstep)
    assert restored is not None and restored[0] == 1  # intact: its checksums match

    def broken(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ckpt.manager, "restore", broken)
    with pytest.raises(PermissionError):
        ckpt.restore_latest(zstep)
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing moved
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_values_other_than_recorded_are_damage_and_the_previous_step_restores(tmp_path, caplog):
    import shutil

    zstep, ckpt = _stage3_with_checkpointer(tmp_path)
    ckpt.save(1, zstep.init(jax.random.key(0)), zstep)
    ckpt.save(2, zstep.init(jax.random.key(1)), zstep)
    ckpt.wait()
    # step 2's files replaced by step 1's: all readable, none of them the values step 2 wrote
    ckpts = tmp_path / "checkpoints"
    shutil.rmtree(ckpts / "2" / "state")
    shutil.copytree(ckpts / "1" / "state", ckpts / "2" / "state")
    with caplog.at_level("WARNING"):
        restored = ckpt.restore_latest(zstep)
    ckpt.close()
    assert restored is not None and restored[0] == 1
    assert "step 2: leaf " in caplog.text and "(checksum mismatch)" in caplog.text, caplog.text
    assert (tmp_path / "damaged-checkpoint-2").is_dir()


def test_a_duplicated_ctrl_c_is_one_stop_a_later_one_stops_at_once():
    from zjax.training._preempt import REPEAT_S, PreemptionGuard

    guard = PreemptionGuard()
    guard._handle(signal.SIGINT, None)
    guard._handle(signal.SIGINT, None)  # the same Ctrl-C, forwarded again by zjax launch
    assert guard.signum == signal.SIGINT
    guard._first -= REPEAT_S + 1
    with pytest.raises(KeyboardInterrupt):
        guard._handle(signal.SIGINT, None)
