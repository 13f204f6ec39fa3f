"""LoRA: adapters trained over a frozen base under every ZeRO stage.

The engine's part is checked against plain single-device optax on the adapters alone (the
base a constant), at FP32 tolerance with float32 gathers; the configured run (``lora``
section, bfloat16 base) starts exactly at the base model's loss and changes nothing but its
adapters.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import (
    adam_moments,
    assert_matches_reference,
    compile_on,
    make_tx,
    nested_paths,
    reference_run,
    train_steps,
)
from models import TINY_LLAMA, token_batches

import zjax
from zjax.lora import LoraConfig, is_adapter
from zjax.models import Llama, lm_loss
from zjax.partition.plan import path_str
from zjax.planning import collective_bytes

LORA = LoraConfig(rank=4, alpha=8.0)


def _lora_trainable(lora: LoraConfig = LORA) -> zjax.Trainable:
    """The tiny Llama with adapters, its base frozen in float32 (the engine's exactness)."""
    t = zjax.from_nnx(lambda rngs: Llama(TINY_LLAMA, rngs=rngs, lora=lora), lm_loss)
    return dataclasses.replace(t, frozen=lambda path: not is_adapter(path))


def _split(params):
    """(adapters, base) of a full pure-dict tree, each a flat {path: leaf}."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    return ({k: v for k, v in flat.items() if is_adapter(k)},
            {k: v for k, v in flat.items() if not is_adapter(k)})



@pytest.fixture(scope="module")
def reference():
    """Five batches and single-device optax on the adapters, the base a constant."""
    batches = token_batches(5)
    full = _lora_trainable().init(jax.random.key(0))
    _, base = _split(full)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(TINY_LLAMA, rngs=nnx.Rngs(0),
                                                         lora=LORA)))

    def loss(adapters, batch):
        return lm_loss(nnx.merge(graphdef, nested_paths({**base, **adapters})), batch)

    init = lambda rng: nested_paths(_split(_lora_trainable().init(rng))[0])
    return batches, full, reference_run(init, lambda a, b: loss(_split(a)[0], b), make_tx(),
                                        batches)


@pytest.mark.parametrize(("stage", "prefetch", "data", "model"), [
    pytest.param(3, 1, 8, 1),  # the quick loop's case
    pytest.param(3, 1, 4, 2, marks=pytest.mark.slow),  # adapters under tensor parallelism
    *(pytest.param(s, 0, 8, 1, marks=pytest.mark.slow) for s in (0, 1, 2)),
])
def test_adapters_train_as_single_device_optax_and_the_base_never_changes(
        reference, stage, prefetch, data, model):
    batches, full, expected = reference
    zero = zjax.ZeroConfig(stage=stage, prefetch_layers=prefetch, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32")
    mesh = zjax.make_mesh(zjax.MeshConfig(data=data, model=model))
    zstep, state, losses = train_steps(_lora_trainable(), zero, batches, mesh=mesh)
    assert_matches_reference(losses, state, expected)
    # the state's trained leaves are the adapters, its frozen ones the base, bit for bit
    trained = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    assert trained and all(map(is_adapter, trained))
    flat = lambda tree: {path_str(p): np.asarray(x)
                         for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    start, got = flat(zstep.init(jax.random.key(0)).frozen), flat(state.frozen)
    assert got.keys() == _split(full)[1].keys()
    for k, v in start.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_only_the_adapters_gradients_are_reduced_and_the_base_moves_in_its_own_bytes():
    """Stage 3, bfloat16 gathers, the compiled step's collectives: the reduce-scatters carry
    the adapters' float32 gradients and nothing of the base (no gradient is computed for it);
    the base's stacked leaves are gathered twice (forward, and backward for the input
    gradients), in bfloat16."""
    zero = zjax.ZeroConfig(stage=3, prefetch_layers=1, param_persistence_threshold=0,
                           gather_dtype="bfloat16", reduce_dtype="float32")
    zstep = zjax.make_step(_lora_trainable(), make_tx(), zero=zero, mesh=zjax.make_mesh())
    cb = collective_bytes(compile_on(zstep.lower(jax.ShapeDtypeStruct((16, 17), np.int32)))
                          .as_text())
    sharded = [leaf for leaf in zstep.plan.leaves if leaf.dim is not None]
    adapters = sum(leaf.size for leaf in sharded if not leaf.frozen)
    base = sum(leaf.size for leaf in sharded if leaf.frozen and leaf.stacked)
    assert adapters and base > 4 * adapters  # the reduce-scatters could not hide it
    assert abs(cb.reduce_scatter - 4 * adapters) <= 0.02 * 4 * adapters, (cb, adapters)
    assert cb.all_gather >= 2 * 2 * base, (cb, base)


TINY_RUN = ["model.n_layers=2", "data.seq_len=32", "data.batch_size=8", "train.steps=4",
            "train.eval_every=0", "train.log_every=1", "logging.progress=false", "data.path=",
            "optimizer.warmup_steps=0", "optimizer.lr=0.01", "optimizer.schedule=constant",
            "checkpoint.every=2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 4-step LoRA run of the tiny Llama template (rank 4 on every linear layer, bfloat16
    base) and its run directory."""
    run = tmp_path_factory.mktemp("lora") / "run"
    config = zjax.load_config("configs/llama-tiny.yaml", [*TINY_RUN, "lora.rank=4",
                                                           "lora.alpha=16"])
    return config, zjax.train(None, config, run_dir=run), run


def test_step_0_is_the_base_model_and_only_adapters_are_trained(lora_run):
    config, result, _ = lora_run
    base_config = dataclasses.replace(config, lora=LoraConfig())
    batch = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    base, lora = zjax.build_step(base_config), zjax.build_step(config)
    s0, s1 = base.init(jax.random.key(0)), lora.init(jax.random.key(0))
    # the same base weights (bfloat16: what the base model's stage-3 gathers move) and B = 0
    assert float(base.evaluate(s0.params, base.put_batch(batch))) == \
        float(lora.evaluate(s1.params, lora.put_batch(batch), s1.frozen))
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < losses[0]
    # optimizer state: two moments of the adapters alone, under 10% of the base here
    n_adapters = sum(x.size for x in jax.tree.leaves(result.state.params))
    n_base = sum(x.size for x in jax.tree.leaves(result.state.frozen))
    mu, _ = adam_moments(result.state.opt_state)
    assert sum(x.size for x in jax.tree.leaves(mu)) == n_adapters < 0.1 * n_base
    assert {x.dtype for x in jax.tree.leaves(result.state.frozen)} == {np.dtype("bfloat16")}


def test_the_peft_export_is_peft_s_format(lora_run, tmp_path):
    """``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT saves them: one
    ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` per adapted module and layer, under
    ``base_model.model.``, holding the run's adapters."""
    import json

    from safetensors.numpy import load_file

    from zjax.export import export

    config, result, run = lora_run
    out = export(run, tmp_path / "adapter", dtype="float32", format="peft")
    meta = json.loads((out / "adapter_config.json").read_text())
    assert {k: meta[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "use_rslora",
                                 "bias", "lora_dropout")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 16.0,
        "use_rslora": False, "bias": "none", "lora_dropout": 0.0}
    assert sorted(meta["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    tensors = load_file(out / "adapter_model.safetensors")
    m = config.model
    hd = m.d_model // m.n_heads
    shapes = {"self_attn.q_proj": (m.n_heads * hd, m.d_model),
              "self_attn.k_proj": (m.n_kv_heads * hd, m.d_model),
              "self_attn.o_proj": (m.d_model, m.n_heads * hd),
              "mlp.down_proj": (m.d_model, m.d_ff)}
    assert len(tensors) == m.n_layers * 7 * 2
    for module, (d_out, d_in) in shapes.items():
        for i in range(m.n_layers):
            name = f"base_model.model.model.layers.{i}.{module}"
            assert tensors[f"{name}.lora_A.weight"].shape == (4, d_in), name
            assert tensors[f"{name}.lora_B.weight"].shape == (d_out, 4), name
    layers = jax.device_get(result.state.params)["blocks"]["layers"]
    np.testing.assert_array_equal(
        tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"],
        np.asarray(layers["wq_lora_a"][1], np.float32).T)
    np.testing.assert_array_equal(
        tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"],
        np.asarray(layers["w_down_lora_b"][0], np.float32).T)
    assert np.abs(layers["w_down_lora_b"][0]).max() > 0  # trained away from PEFT's zeros


def test_the_plan_counts_the_adapters_and_their_state_apart_from_the_base():
    """Stage 3, every leaf sharded over the 8 devices: gradients (float32) and Adam's two
    moments are the adapters' alone; the stored params are the float32 adapters and the
    bfloat16 base."""
    config = zjax.load_config("configs/llama-tiny.yaml", [
        *TINY_RUN, "lora.rank=4", "zero.param_persistence_threshold=0"])
    report = zjax.plan(config)
    zstep = zjax.build_step(config)
    trained = sum(leaf.size for leaf in zstep.plan.leaves if not leaf.frozen)
    base = sum(leaf.size for leaf in zstep.plan.leaves if leaf.frozen)
    assert report.frozen == {"trained_params": trained, "frozen_params": base,
                             "frozen_bytes": 2 * base // 8, "frozen_dtypes": ["bfloat16"]}
    assert report.n_params == trained + base
    d = report.per_device
    assert d["grads_bytes"] == 4 * trained // 8
    assert 8 * trained // 8 <= d["optimizer_bytes"] <= 8 * trained // 8 + 64  # + step counts
    assert d["params_bytes"] == 4 * trained // 8 + 2 * base // 8
    table = report.table()
    assert f"{trained:,} trained" in table and f"({base:,} params, bfloat16)" in table


def test_a_resumed_lora_run_is_the_straight_run_bit_for_bit(lora_run, tmp_path):
    """Two steps, then a resume to four: its checkpoints hold the adapters and their Adam
    state only (the base rebuilt as the run started), and the result is the straight run's."""
    config, straight, _ = lora_run
    first = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2))
    zjax.train(None, first, run_dir=tmp_path / "run")
    resumed = zjax.train(None, config, run_dir=tmp_path / "run")
    assert [row["step"] for row in resumed.history] == [3, 4]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(straight.state.params))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.opt_state),
                 jax.device_get(straight.state.opt_state))
    saved = tmp_path / "run" / "checkpoints" / "4"
    assert saved.is_dir()
    from zjax.export import read_params

    _, params = read_params(tmp_path / "run")
    assert set(params["blocks"]["layers"]) == {
        f"{w}_lora_{f}" for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
        for f in "ab"}
    assert set(params) == {"blocks"}


def test_a_random_base_run_is_refused_where_its_base_is_needed(lora_run, tmp_path):
    """Sampling a LoRA run, or merging its adapters, needs its base in files: a run over the
    seed's random base says so instead of guessing."""
    from zjax.export import export, load_sampler

    _, _, run = lora_run
    with pytest.raises(zjax.CheckpointError, match=r"^sample: the LoRA run trained over its "
                                                   r"seed's random base"):
        load_sampler(run)
    with pytest.raises(zjax.CheckpointError, match=r"^export --format hf: the LoRA run "
                                                   r"trained over its seed's random base"):
        export(run, tmp_path / "merged", format="hf")
    assert not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_rank_16_adapters_of_llama3_8b_keep_under_2_percent_of_the_full_fine_tune_s_state():
    """``zjax plan configs/llama3-8b.yaml lora.rank=16`` (DeepSpeed's persistence threshold,
    1e5): gradients and optimizer state per device under 2% of the full fine-tune's. The
    adapters are sharded below the threshold (persisting them would replicate 16 bytes of
    state an element)."""
    small = ["data.batch_size=8", "data.seq_len=256", "data.path="]
    full = zjax.plan(zjax.load_config("configs/llama3-8b.yaml", small)).per_device
    lora = zjax.plan(zjax.load_config("configs/llama3-8b.yaml", [*small, "lora.rank=16",
                                                                  "lora.alpha=32"]))
    state = lambda d: d["grads_bytes"] + d["optimizer_bytes"]
    assert state(lora.per_device) < 0.02 * state(full)
    assert not [leaf for leaf in lora.replicated_leaves if "lora" in leaf["path"]]
