"""Issue 50, items 14 and 15: messages that name the keys the user set, one exit rule for
``zjax plan`` when a step does not fit, and a gather-on-use transform whose bugs surface.

Item 14: a mesh, batch or micro-batch error names the config keys that size the axes
involved (``mesh.data 3 x mesh.context 2``: a derived ``data`` size names the keys it came
from), the values and what would fit. ``zjax plan`` exits 2 for what does not fit, whether
the compiler refuses the program or the compiled peak exceeds the target's memory, with
offload or without.

Item 15: the transform falls back to gathering everything only on its own documented refusal
(``CannotRewrite``), once per loss and reason; any other exception is a bug and is raised.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from any_models import TX, jax_loop, train_and_compare, zero3_step
from helpers import ROOT
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
import zjax.cli._main as cli_main
from zjax.cli import main
from zjax.config import load_config
from zjax.errors import ConfigError, GatherFallbackWarning
from zjax.partition import ZeroConfig, _program
from zjax.partition._placement import choose_dim
from zjax.planning import PlanReport
from zjax.planning._longest import LongestResult
from zjax.planning._search import Candidate
from zjax.planning._search import autotune as search

TINY_MOE = [str(ROOT / "configs/llama-tiny.yaml"), "model.n_experts=4",
            "model.experts_per_token=2", "data.seq_len=32", "mesh.expert=2"]


@pytest.fixture
def plan_cli(monkeypatch, capsys, cli_logging):
    """``zjax plan ARGS`` in this process: (exit code, stdout, stderr). The process already
    has 8 simulated devices; ``--devices N`` takes the first N of them."""
    monkeypatch.setattr(cli_main, "_setup_devices", lambda n: None)

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["plan", *args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def _error(err: str) -> str:
    (line,) = [x for x in err.splitlines() if x.startswith("zjax: error: ")]
    assert "Traceback" not in err
    return line.removeprefix("zjax: error: ")


# ---- item 14: the keys the user set --------------------------------------------------------

def test_nothing_to_shard_names_the_context_axis_not_a_derived_data_6(plan_cli):
    rc, _, err = plan_cli("--devices", "6", "mesh.context=2")
    msg = _error(err)
    assert rc == 2 and "data=6" not in msg
    assert "6 shards (mesh.data 3 x mesh.context 2)" in msg
    # the largest leaf and what would shard it, not the threshold (which does not help)
    assert "w_down (4, 512, 128)" in msg and "param_persistence_threshold" not in msg


def test_nothing_to_shard_below_the_threshold_still_advises_the_threshold():
    from zjax.partition._placement import nothing_to_shard
    from zjax.partition.plan import LeafPlan

    leaf = LeafPlan("ln/scale", (64,), jnp.dtype("float32"), False, None,
                    "persistent: 64 elements < param_persistence_threshold 4096", None, "data")
    assert "lower zero.param_persistence_threshold (4096)" in str(nothing_to_shard([leaf], 4096))


def test_batch_error_names_the_axes_a_derived_data_size_came_from(plan_cli):
    rc, _, err = plan_cli("--devices", "6", "mesh.context=2", "zero.stage=2")
    assert rc == 2 and _error(err) == (
        "data.batch_size: the global batch of 16 is not divisible by the data axis (3; the 6 "
        "devices are mesh.data 3 x mesh.context 2); use a multiple of 3")


def test_batch_error_counts_the_expert_axis(plan_cli):
    rc, _, err = plan_cli(*TINY_MOE, "data.batch_size=12")
    assert rc == 2 and _error(err) == (
        "data.batch_size: the global batch of 12 is not divisible by the data x expert axes "
        "(mesh.data 4 x mesh.expert 2 = 8); use a multiple of 8")


def test_grad_accum_with_experts_names_the_expert_axis(plan_cli):
    rc, _, err = plan_cli(*TINY_MOE, "train.grad_accum=8")
    msg = _error(err)
    assert rc == 2 and msg.startswith("train.grad_accum: 8 micro-batches do not divide the "
                                      "local batch of 2 (the global batch of 16 over the data "
                                      "x expert axes (mesh.data 4 x mesh.expert 2 = 8))")
    assert "a multiple of 64" in msg


def test_batch_error_with_replicas_and_a_model_axis(plan_cli):
    rc, _, err = plan_cli("mesh.replica=2", "data.batch_size=12")
    assert rc == 2 and "replica x data axes (mesh.replica 2 x mesh.data 4 = 8)" in _error(err)
    rc, _, err = plan_cli("mesh.model=2", "data.batch_size=6", "zero.stage=2")
    assert rc == 2 and "data axis (4; the 8 devices are mesh.data 4 x mesh.model 2)" \
        in _error(err)


@pytest.mark.parametrize(("args", "needle"), [
    (["--devices", "6", "mesh.data=4"],
     "mesh: data=4 x model=1 = 4 does not equal the 6 devices; set mesh.data (or mesh.model) "
     "to -1"),
    (["--devices", "6", "mesh.context=4"], "mesh.context: 4 does not divide the 6 devices"),
    (["mesh.model=2", "mesh.context=8"],
     "mesh.model: 2 x mesh.context 8 does not divide the 8 devices"),
    (["mesh.expert=2"], "mesh.expert: an expert axis of 2, but the model names no "
                        "parameter dimension"),
    (["mesh.model=8"], "mesh.model: the model axis (8) does not divide the 4 attention heads "
                       "(model.n_heads)"),
])
def test_mesh_errors_name_every_key_and_value(plan_cli, args, needle):
    rc, _, err = plan_cli(*args)
    assert rc == 2 and needle in _error(err)


def test_context_split_names_data_seq_len(plan_cli):
    rc, _, err = plan_cli(str(ROOT / "configs/llama-tiny.yaml"), "mesh.context=4",
                          "data.seq_len=36", "model.context_attention=ring")
    msg = _error(err)
    assert rc == 2 and msg.startswith("mesh.context: a context axis of 4 does not split a "
                                      "sequence of 36 tokens")
    assert "data.seq_len) divisible by 8" in msg


def test_replicated_leaf_reason_names_its_shard_axes():
    dim, why = choose_dim((512, 128), n=6, stacked=False, threshold=0,
                          over="mesh.data 3 x mesh.context 2")
    assert dim is None
    assert why == "no dimension of (512, 128) divisible by its 6 shards (mesh.data 3 x " \
                  "mesh.context 2)"


def test_budget_search_counts_rows_over_data_only_with_a_context_axis():
    """4 devices, mesh.context 2: each batch row is on 2 data shards, 8 rows each."""
    config = load_config(None, ["mesh.context=2"])
    with pytest.raises(ConfigError) as e:
        search(config, budget_bytes=1, compile_report=None, n_devices=4, grad_accum=(3,),
               model=(1,))
    assert str(e.value) == ("--budget: no micro-batch count in (3,) divides the local batch of "
                            "8 (data.batch_size 16 over 2 shards: 4 devices / mesh.context 2)")
    # a count that divides those 8 rows is searched (it was skipped: 16 / 4 devices = 4)
    seen = []

    def compile_report(cfg):
        seen.append(cfg.train.grad_accum)
        raise ConfigError("stop here")

    with pytest.raises(ConfigError, match="could be built"):
        search(config, budget_bytes=1, compile_report=compile_report, n_devices=4,
               grad_accum=(8,), model=(1,), stages=(3,), offloads=("none",), prefetch=(0,))
    assert seen and set(seen) == {8}


# ---- item 14: one exit rule for what does not fit --------------------------------------------

def _report(*, fits: bool, offload: str) -> PlanReport:
    per = {k: 0 for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes",
                          "temp_bytes", "host_bytes", "host_temp_bytes", "nvme_bytes")}
    per.update(total_bytes=3 * 2**30, capacity_bytes=(4 if fits else 2) * 2**30)
    setting = {"stage": 3, "offload": offload, "prefetch": 1, "grad_accum": 1, "remat": True,
               "mesh": {"data": 8, "model": 1}, "target": "v5p:2x2x2"}
    return PlanReport(1, 8, setting, per, {"wire_bytes": 0}, dict(per), [],
                      device_kind="TPU v5", fits_device=fits)


@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+param"])
def test_a_target_step_over_the_memory_exits_2_with_or_without_offload(plan_cli, monkeypatch,
                                                                        offload):
    import zjax.planning as planning

    for fits, code in ((True, 0), (False, 2)):
        monkeypatch.setattr(planning, "plan", lambda *a, fits=fits, **k: _report(
            fits=fits, offload=offload))
        rc, out, err = plan_cli("--target", "v5p:2x2x2")
        assert rc == code
        assert ("DOES NOT FIT" if code else "fits") in out  # the report is printed either way
        if code:
            assert _error(err) == (
                "--target v5p:2x2x2: does not fit: the step needs 3.00 GiB per device, over "
                "the 2.00 GiB of device memory; use more devices, a smaller data.batch_size or "
                "data.seq_len, gradient accumulation (train.grad_accum) or offload "
                "(zero.offload_*)")
        rc, out, _ = plan_cli("--target", "v5p:2x2x2", "--json")  # the same rule for scripts
        assert rc == code and '"fits_device": ' in out


@pytest.mark.slow  # quick loop: 6 s
def test_a_real_h100_compile_over_the_memory_exits_2(plan_cli):
    """The GPU compiler compiles a step over 80 GB (libtpu would refuse it): 2 either way."""
    rc, out, err = plan_cli("--target", "h100:8", "data.batch_size=2097152")
    assert rc == 2 and "DOES NOT FIT" in out
    assert _error(err).startswith("--target h100:8: does not fit: the step needs ")


def test_longest_seq_with_nothing_that_fits_exits_2(plan_cli, monkeypatch):
    import zjax.planning as planning

    monkeypatch.setattr(planning, "longest_sequence", lambda *a, **k: LongestResult(
        0, None, [(1024, 5 * 2**30, False)], 2**30))
    rc, out, err = plan_cli("--budget", "1GiB", "--longest-seq")
    assert rc == 2 and "no sequence length tried fits" in out
    assert _error(err).startswith("--longest-seq: no length tried fits the budget of 1.00 GiB "
                                  "per device (not even 1,024 tokens)")


def test_plan_help_states_the_exit_rule(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "exit codes: 0 the plan was made" in out and "The same with offload or without" in out


# ---- item 15: only the documented refusal falls back ----------------------------------------

def _lower_step_and_evaluation(zstep) -> None:
    spec = jax.ShapeDtypeStruct((16, 9), jnp.int32,
                                sharding=NamedSharding(zjax.make_mesh(), P("data")))
    zstep.lower(spec)
    jax.jit(zstep.evaluate).lower(zstep.abstract_state.params, spec)


@pytest.mark.parametrize(("where", "error"), [
    ("_segments", TypeError("a bug in the analysis")),
    ("_roots", KeyError("a bug in the analysis")),
])
def test_a_bug_in_the_analysis_is_raised_not_hidden(monkeypatch, where, error):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(_program, where, broken)
    zstep, _, _ = zero3_step("jax_loop")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GatherFallbackWarning)  # no silent fallback either
        with pytest.raises(type(error), match="a bug in the analysis"):
            _lower_step_and_evaluation(zstep)


@pytest.mark.parametrize("message", ["a bug in the rewrite",
                                     "a bug in the rewrite: incompatible shapes"])
def test_a_bug_in_the_rewrite_is_raised_not_hidden(monkeypatch, message):
    """Nor renamed: a shape error inside the transform was reported as the user's shard
    "used without being gathered" (a NotGatheredError, exit 2 without a traceback)."""
    from zjax.partition import transform

    def broken(*args, **kwargs):
        raise ValueError(message)

    monkeypatch.setattr(transform, "_run_plain", broken)
    zstep, _, _ = zero3_step("jax_loop")
    with pytest.raises(ValueError, match=f"^{message}(\n|$)"):
        _lower_step_and_evaluation(zstep)


def test_a_scan_the_analysis_does_not_read_falls_back_with_one_warning(monkeypatch):
    """A scan without a parameter the schedule reads (as a JAX that writes scans otherwise
    would give): the step and the evaluation are traced, one warning names the construct."""
    monkeypatch.setattr(_program, "_SCAN_PARAMS", (*_program._SCAN_PARAMS, "layout"))
    zstep, init, loss = zero3_step("jax_scan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lower_step_and_evaluation(zstep)
        train_and_compare(zstep, init, loss, n=2)  # the fallback is correct
    fallbacks = [str(w.message) for w in caught if w.category is GatherFallbackWarning]
    assert fallbacks == [
        "zjax cannot schedule the model's gathers layer by layer: the loss holds a scan "
        "without the parameter layout (a form of JAX's scan zjax does not read); every "
        "parameter is gathered at the start of the loss instead (correct, but the whole model "
        "is materialised on every device)"]


def test_a_loss_returning_a_parameter_is_rewritten_not_a_fallback():
    """It fell back on a KeyError (the leaf was gathered only inside its layer)."""
    init, loss = jax_loop()

    def with_weight(params, tokens):  # a view of a sharded leaf among the outputs
        s, c = loss(params, tokens)
        return s, c, {"w_tokens": params["layers"][0]["up"].reshape(-1)}

    zstep = zjax.make_step(zjax.from_pytree(init, with_weight), TX, mesh=zjax.make_mesh(),
                           zero=ZeroConfig(stage=3, param_persistence_threshold=0,
                                           gather_dtype="float32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GatherFallbackWarning)
        train_and_compare(zstep, init, loss, n=2)
        state = zstep.init(jax.random.key(0))
        from models import token_batches

        _, metrics = zstep.step(state, zstep.put_batch(token_batches(1, batch=16, seq=8)[0]))
    up = init(jax.random.key(0))["layers"][0]["up"].reshape(-1)
    assert jnp.allclose(metrics["w_tokens"], 8 * up, atol=1e-6)  # summed over the 8 ranks


def test_an_empty_layer_scan_is_not_scheduled_nor_a_fallback():
    """A scan over 0 stacked layers fell back on a TypeError (the schedule sliced layer 0)."""
    def init(rng):
        return {"embed": jax.random.normal(rng, (64, 32)), "up": jnp.zeros((0, 32, 128)),
                "down": jnp.zeros((0, 128, 32))}

    def loss(p, t):
        h = p["embed"][t[:, :-1]]
        h = jax.lax.scan(lambda h, w: (h + jax.nn.gelu(h @ w[0]) @ w[1], None), h,
                         (p["up"], p["down"]))[0]
        logits = h @ p["embed"].T
        picked = jnp.take_along_axis(logits, t[:, 1:, None], -1)[..., 0]
        return jnp.sum(jax.nn.logsumexp(logits, -1) - picked), jnp.float32(picked.size)

    zstep = zjax.make_step(zjax.from_pytree(init, loss), TX, mesh=zjax.make_mesh(),
                           zero=ZeroConfig(stage=3, param_persistence_threshold=0,
                                           gather_dtype="float32"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lower_step_and_evaluation(zstep)
    assert not [w for w in caught if "cannot schedule" in str(w.message)]


def test_candidate_keeps_the_context_axis():
    """The search's candidates keep mesh.context (its local batch counts on it)."""
    config = load_config(None, ["mesh.context=2"])
    assert Candidate(3, 1).apply(config).mesh.context == 2


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"),
                                   TypeError("a bug reading metadata")])
def test_metadata_that_fails_other_than_by_damage_surfaces_and_nothing_moves(tmp_path,
                                                                              monkeypatch, error):
    """A sibling broad catch: any error reading a checkpoint's metadata counted as damage, so
    an intact checkpoint was moved aside and training fell back to an older one."""
    from zjax.checkpoint import CheckpointConfig, Checkpointer

    zstep, _, _ = zero3_step("jax_loop")
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(asynchronous=False))
    ckpt.save(1, zstep.init(jax.random.key(0)), zstep)
    ckpt.wait()

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt.manager, "item_metadata", broken)
    with pytest.raises(type(error)):
        ckpt.restore_latest(zstep)
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing moved
    assert (tmp_path / "checkpoints" / "1").is_dir()
