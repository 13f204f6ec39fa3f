"""The mixture-of-experts layer (``zjax.nn.moe``) and the reference Llama's experts option.

- The layer equals a plain reference that runs every expert on every token and masks
  (values and gradients, ``helpers.FP32``), dropless and with a capacity, which drops the
  assignments GShard's rule (a queue per expert, first choices first) drops.
- Its load-balance statistic is Hugging Face's ``load_balancing_loss_func`` (written again in
  numpy, with an attention mask), its z-loss ST-MoE's.
- Training a Llama with experts (shared ones, both router losses, packed documents with
  padding) equals single-device optax at stage 3 and with tensor parallelism; a capacity's
  dropped assignments are counted per step (``moe_dropped_tokens``) over each device's tokens.
- Bad settings are refused naming the key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FP32,
    assert_matches_reference,
    assert_trees_close,
    compiled_for,
    make_tx,
    reference_run,
    train_steps,
)
from models import TINY_LLAMA, llama_reference_loss, llama_trainable, token_batches

import zjax
from zjax.models import LlamaConfig
from zjax.nn.moe import Experts, capacity, moe_ffn, route, tiled_mlp

E, K, N, D, F = 4, 2, 40, 16, 24


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (N, D), jnp.float32)
    router = jax.random.normal(keys[1], (D, E), jnp.float32)
    w = Experts(*(0.3 * jax.random.normal(kk, s, jnp.float32) for kk, s in
                  zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)))
    return x, router, w


def _queue_kept(top: np.ndarray, cap: int) -> np.ndarray:
    """GShard's rule as a queue per expert: all first choices, then all second ones, each in
    token order; an expert takes the first ``cap`` that reach it."""
    kept = np.zeros(top.shape, bool)
    filled = np.zeros(E, int)
    for j in range(top.shape[1]):
        for t in range(top.shape[0]):
            e = top[t, j]
            if filled[e] < cap:
                kept[t, j], filled[e] = True, filled[e] + 1
    return kept


def _reference(x, router, w, *, k, renormalize, kept=None):
    """Every expert on every token, masked to the tokens that chose it."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    top = jnp.argsort(-probs, axis=-1)[:, :k]
    weights = jnp.take_along_axis(probs, top, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    if kept is not None:
        weights = weights * kept
    y = jnp.zeros_like(x)
    for e in range(E):
        mask = jnp.sum(jnp.where(top == e, weights, 0.0), axis=-1)
        h = jax.nn.silu(x @ w.gate[e]) * (x @ w.up[e])
        y = y + mask[:, None] * (h @ w.down[e])
    return y, np.asarray(top)


def _check(factor, renormalize, matmul="auto"):
    x, router, w = _inputs()
    kept = None
    if factor is not None:
        top = _reference(x, router, w, k=K, renormalize=renormalize)[1]
        kept = _queue_kept(top, capacity(N, K, E, factor))
        assert 0 < (~kept).sum() < kept.size // 2  # some dropped, most kept
    # a random cotangent and the sum of its product: values and every gradient compared
    ct = jax.random.normal(jax.random.key(9), (N, D), jnp.float32)
    got_fn = lambda *a: jnp.sum(ct * moe_ffn(a[0], a[1], Experts(*a[2:]), k=K,
                                              renormalize=renormalize,
                                              capacity_factor=factor, matmul=matmul)[0])
    want_fn = lambda *a: jnp.sum(ct * _reference(a[0], a[1], Experts(*a[2:]), k=K,
                                                 renormalize=renormalize, kept=kept)[0])
    args = (x, router, *w)
    got, want = jax.value_and_grad(got_fn, argnums=range(5))(*args), \
        jax.value_and_grad(want_fn, argnums=range(5))(*args)
    assert abs(float(want[0])) > 1.0
    assert_trees_close(got, want, **FP32, what="value and grads")
    return kept


@pytest.mark.parametrize("renormalize,matmul", [(True, "tiled"), (False, "tiled"),
                                                 (True, "ragged_dot")])
def test_dropless_equals_the_masked_reference(renormalize, matmul):
    _check(None, renormalize, matmul)


@pytest.mark.parametrize("sizes,tile", [((5, 0, 9, 3), 8), ((0, 0, 17, 0), 8), ((1, 2, 3, 4), 256)])
def test_tiled_grouped_matmul_equals_one_row_at_a_time(sizes, tile):
    """Rows sorted by expert with padding rows after them, an expert with no rows, an expert
    over several tiles: the tiled MLP's values and every gradient equal each row through its own
    expert (each row against its own gathered weights), and the padding rows come out zero with
    zero gradients."""
    rows = sum(sizes) + 6
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (rows, D), jnp.float32)
    w = [jax.random.normal(k, s, jnp.float32) / 4
         for k, s in zip(ks[1:4], [(E, D, F), (E, D, F), (E, F, D)], strict=True)]
    ct = jax.random.normal(ks[4], (rows, D), jnp.float32)
    expert = np.repeat(np.arange(E), sizes)

    def want_fn(x, g, u, dn):
        real = x[:len(expert)]
        h = jax.nn.silu(jnp.einsum("nd,ndf->nf", real, g[expert])) * \
            jnp.einsum("nd,ndf->nf", real, u[expert])
        y = jnp.einsum("nf,nfd->nd", h, dn[expert])
        return jnp.sum(ct[:len(expert)] * y), y

    got_fn = lambda x, g, u, dn: (lambda y: (jnp.sum(ct * y), y))(
        tiled_mlp(x, g, u, dn, jnp.asarray(sizes, jnp.int32), activation=jax.nn.silu,
                  tile=tile))
    (got, y), grads = jax.value_and_grad(got_fn, argnums=range(4), has_aux=True)(x, *w)
    (want, y_want), grads_want = jax.value_and_grad(want_fn, argnums=range(4), has_aux=True)(
        x, *w)
    assert_trees_close((got, y[:len(expert)], grads[1:]), (want, y_want, grads_want[1:]), **FP32,
                       what="values and weight grads")
    assert_trees_close(grads[0][:len(expert)], grads_want[0][:len(expert)], **FP32, what="dx")
    assert not np.asarray(y[len(expert):]).any() and not np.asarray(grads[0][len(expert):]).any()
    empty = [e for e in range(E) if sizes[e] == 0]
    assert all(not np.asarray(g[e]).any() for g in grads[1:] for e in empty)


def test_capacity_drops_what_the_queue_rule_drops():
    kept = _check(0.75, True)
    x, router, w = _inputs()
    _, stats = moe_ffn(x, router, w, k=K, capacity_factor=0.75)
    assert float(stats.dropped) == (~kept).sum()


def test_balance_and_z_losses_are_huggingfaces():
    x, router, w = _inputs(1)
    mask = (np.arange(N) % 7 != 3).astype(np.float32)  # some padding
    _, stats = moe_ffn(x, router, w, k=K, mask=jnp.asarray(mask))
    # transformers' load_balancing_loss_func (4.57) for one layer, with an attention mask
    logits = np.asarray(x @ router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :K]
    onehot = np.eye(E)[top]  # [N, K, E]
    per_expert = (onehot * mask[:, None, None]).sum(0) / mask.sum()
    prob_per_expert = (probs * mask[:, None]).sum(0) / mask.sum()
    want = E * np.sum(per_expert * prob_per_expert[None])
    np.testing.assert_allclose(float(stats.balance), want, rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(stats.z), np.sum(mask * lse ** 2) / mask.sum(), rtol=1e-5)
    routing = route(jnp.asarray(logits, jnp.float32), k=K)
    np.testing.assert_array_equal(np.asarray(routing.experts), top)


MOE = dataclasses.replace(TINY_LLAMA, n_experts=4, experts_per_token=2, n_shared_experts=1,
                          moe_d_ff=16, router_aux_loss_coef=0.1, router_z_loss_coef=0.01)


def _packed(batches):
    out = []
    for b in batches:
        seg = np.ones_like(b)
        seg[:, 7:] = 2
        seg[::2, -3:] = 0  # padding: the router's statistics leave it out
        out.append({"tokens": b, "segment_ids": seg})
    return out


@pytest.fixture(scope="module")
def reference():
    batches = _packed(token_batches(4))
    loss = llama_reference_loss(MOE)
    return batches, reference_run(llama_trainable(MOE).init, lambda p, b: loss(p, b)[:2],
                                  make_tx(), batches)


def _zero(stage=3, **kw):
    return zjax.ZeroConfig(stage=stage, prefetch_layers=1, param_persistence_threshold=0,
                           gather_dtype="float32", reduce_dtype="float32", **kw)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(("stage", "data", "model", "expert", "offload"), [
    # the quick loop keeps expert parallelism over ZeRO-3
    pytest.param(3, 8, 1, 1, False, id="s3-d8", marks=_SLOW),
    pytest.param(3, 4, 1, 2, False, id="s3-d4-e2"),
    pytest.param(3, 4, 2, 1, False, id="s3-d4-m2", marks=_SLOW),
    pytest.param(3, 2, 1, 4, False, id="s3-d2-e4", marks=_SLOW),
    pytest.param(3, 2, 2, 2, False, id="s3-d2-m2-e2", marks=_SLOW),  # tensor x expert
    pytest.param(3, 4, 1, 2, True, id="s3-d4-e2-offload", marks=_SLOW),
    pytest.param(2, 4, 1, 2, False, id="s2-d4-e2", marks=_SLOW),
    pytest.param(0, 4, 1, 2, False, id="s0-d4-e2", marks=_SLOW),
])
def test_training_matches_single_device(reference, stage, data, model, expert, offload):
    batches, expected = reference
    zero = _zero(stage, **(dict(offload_optimizer={"device": "cpu"},
                                offload_param={"device": "cpu"}) if offload else {}))
    mesh = zjax.make_mesh(zjax.MeshConfig(data=data, model=model, expert=expert))
    zstep, state, losses = train_steps(llama_trainable(MOE), zero, batches, mesh=mesh)
    assert_matches_reference(losses, state, expected)
    plan = zstep.plan
    leaf, attn = plan.leaves_by_path["blocks/layers/w_gate"], plan.leaves_by_path[
        "blocks/layers/wq"]
    assert leaf.shape == (3, 4, 32, 16)
    if model > 1:  # each expert's hidden units split over model
        assert leaf.model_dim == 3
    if expert > 1:  # experts over the expert axis, ZeRO over the data devices holding them
        assert leaf.expert_dim == 1 and leaf.data_axes == "data"
        assert attn.data_axes == ("data", "expert")
        assert plan.leaf_bytes(leaf, np.float32, stage >= 1) == leaf.size * 4 // (
            expert * model * (data if stage >= 1 else 1))


@_SLOW
def test_capacity_under_expert_parallelism_is_the_data_parallel_capacity():
    """Each device's tokens are one capacity group either way: expert parallelism moves the
    same buffers, so training is the same (rounding apart)."""
    cfg = dataclasses.replace(MOE, capacity_factor=1.0)
    batches = token_batches(2)
    runs = [train_steps(llama_trainable(cfg), _zero(), batches,
                        mesh=zjax.make_mesh(zjax.MeshConfig(data=8 // e, expert=e)))
            for e in (1, 4)]
    np.testing.assert_allclose(runs[1][2], runs[0][2], rtol=1e-6)
    assert_trees_close(runs[1][1].params, runs[0][1].params, **FP32, what="params")


@_SLOW
def test_checkpoints_move_between_expert_parallel_sizes_bitwise(tmp_path):
    from zjax.checkpoint import CheckpointConfig, Checkpointer

    def make(data, expert):
        mesh = zjax.make_mesh(zjax.MeshConfig(data=data, expert=expert))
        return zjax.make_step(llama_trainable(MOE), make_tx(), zero=_zero(), mesh=mesh)

    zstep = make(4, 2)
    state = zstep.init(jax.random.key(0))
    for b in token_batches(2):
        state, _ = zstep.step(state, zstep.put_batch(b))
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    ckpt.save(2, state, zstep)
    ckpt.wait()
    saved = jax.device_get((state.params, state.opt_state))
    for data, expert in ((2, 4), (8, 1)):
        other = make(data, expert)
        restored, _, _ = ckpt.restore(2, other)
        got = jax.device_get((restored.params, restored.opt_state))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(x, y)
        w = restored.params["blocks"]["layers"]["w_gate"]
        assert w.sharding.spec == other.plan.param_specs["blocks"]["layers"]["w_gate"]
    ckpt.close()


@pytest.mark.slow  # quick loop: 11 s
def test_capacity_counts_each_devices_dropped_assignments():
    cfg = dataclasses.replace(MOE, n_shared_experts=0, capacity_factor=0.5)
    batch = token_batches(1)[0]
    zero = zjax.ZeroConfig(stage=3, param_persistence_threshold=0)
    zstep, state, _ = train_steps(llama_trainable(cfg), zero, [])
    params = jax.device_get(state.params)  # the step donates the state
    _, metrics = zstep.step(state, zstep.put_batch(batch))
    # the same params on one device, each device's 2 rows a group of its own
    from flax import nnx

    from zjax.models import Llama, lm_loss
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, params)
    want = sum(float(lm_loss(model, jnp.asarray(batch[i:i + 2]))[2]["moe_dropped_tokens"])
               for i in range(0, 16, 2))
    assert want > 0
    assert float(metrics["moe_dropped_tokens"]) == want


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(n_experts=4, experts_per_token=5),
     r"^model\.experts_per_token: 5 exceeds model\.n_experts 4"),
    (dict(n_shared_experts=1), r"^model\.n_shared_experts: 1 needs model\.n_experts"),
    (dict(n_experts=4, mlp_chunk=64), r"^model\.mlp_chunk: 64 tiles a dense MLP"),
    (dict(n_experts=4, capacity_factor=0), r"^model\.capacity_factor"),
])
def test_bad_expert_settings_name_the_key(overrides, message):
    with pytest.raises(zjax.ConfigError, match=message):
        LlamaConfig(**overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.n_experts=8", "mesh.expert=3"], "mesh.expert: 3 does not divide model.n_experts 8"),
    (["model.n_experts=6", "mesh.expert=3"], "mesh.expert: 3 does not divide the 8 devices"),
    (["mesh.expert=2"], "mesh.expert: 2 splits a mixture's experts, but the model is dense"),
    (["model.n_experts=4", "model.experts_per_token=5"],
     "model.experts_per_token: 5 exceeds model.n_experts 4"),
])
def test_the_cli_refuses_expert_settings_that_cannot_place(overrides, message, capsys):
    from zjax import cli

    code = cli.main(["plan", "configs/llama-tiny.yaml", "data.path=", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"zjax: error: {message}"), err


@pytest.mark.slow  # quick loop: 12 s
def test_the_plan_counts_active_parameters_and_the_experts_figures():
    """``zjax plan``: total and active parameters (the chosen and shared experts), model FLOPs
    (MFU's numerator) of the active ones, 6 N_active + 12 L H Q T per token, and with
    ``mesh.expert``: the experts each device holds, their stored and gathered bytes, and the
    all-to-all bytes (capacity 1: buffers of exactly k bf16 rows of d per token; dispatch and
    combine, in the forward, its recomputation and the backward)."""
    config = zjax.load_config("configs/llama-tiny.yaml", [
        "model.n_experts=4", "model.experts_per_token=2", "model.n_shared_experts=1",
        "model.moe_d_ff=64", "model.capacity_factor=1.0", "mesh.expert=2", "data.path=",
        "data.batch_size=8"])
    report = zjax.plan(config)
    m = config.model
    routed = m.n_layers * m.n_experts * 3 * m.d_model * 64
    assert report.active_params == report.n_params - routed // 2  # 2 of 4 experts a token
    attention = 12 * m.n_layers * m.n_heads * m.head_width * config.data.seq_len
    assert report.flops["per_token"] == 6 * report.active_params + attention
    table = report.table()
    assert f"{report.n_params:,} parameters ({report.active_params:,} active per token)" \
        in table
    tokens = 8 * config.data.seq_len // 8  # per device
    a2a = 6 * tokens * 2 * m.d_model * 2 * m.n_layers
    assert report.setting["mesh"]["expert"] == 2
    assert report.experts == {
        "n_experts": 4, "experts_per_device": 2, "expert_params": routed,
        "params_bytes": routed * 4 // 8,  # float32, over expert 2 x data 4
        "gathered_layer_bytes": routed // m.n_layers // 2 * 2,  # 2 experts, bf16
        "all_to_all_bytes": a2a, "all_to_all_off_device_bytes": a2a // 2,
        "all_to_all_per_layer": a2a // m.n_layers}
    assert report.collectives["all_to_all_bytes"] == a2a
    assert not report.context_per_layer
    assert "experts: 4 (2 per device)" in table


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expert"), [("cpu", 2), ("cpu", 4), ("h100:2x4", 2),
                                              ("v5p:2x2x2", 2)])
def test_all_to_all_bytes_equal_the_formula_on_every_backend(name, expert):
    """Capacity 1: each layer's forward moves 2 x tokens x k x d_model bf16 (dispatch and
    combine), over groups of the ``expert`` axis; its recomputation and backward as much
    again each. (Dropless: ``tests/test_moe_exchange.py``.)"""
    from zjax.planning import collective_sites, group_size

    moe = ("model.n_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64",
           f"mesh.expert={expert}", "data.batch_size=16")
    tokens, k, d, layers = 16 * 64 // 8, 2, 128, 2  # per device; TARGET_BASE's 2 layers
    forward = 2 * tokens * k * d * 2 * layers
    _, compiled, report = compiled_for(name, *moe, "model.capacity_factor=1.0",
                                       file="configs/llama-tiny.yaml")
    assert report.experts["all_to_all_bytes"] == 3 * forward
    assert report.experts["all_to_all_off_device_bytes"] == 3 * forward * (expert - 1) // expert
    sites = [s for s in collective_sites(compiled.as_text(),
                                         decomposed=name.startswith("v5p"))
             if s.kind == "all_to_all"]
    assert sites and {group_size(s.line) for s in sites} == {expert}


@pytest.mark.slow  # a compile for the H100 target
def test_a_dropless_step_compiles_for_a_gpu_without_one():
    """A device's dropless assignments sorted by expert (4096 tokens x top-2 from each of 4
    expert-parallel devices) compile for the compile-only H100 target: XLA:GPU's CUB radix
    sort, which sizes its scratch through the CUDA runtime, is off on GPU (the Backend's
    ``xla_gpu_enable_cub_radix_sort``), so the plan is of the program a GPU runs."""
    _, _, report = compiled_for(
        "h100:8", "model.n_experts=4", "model.experts_per_token=2", "model.moe_d_ff=64",
        "mesh.expert=4", "data.batch_size=8", "data.seq_len=4096", "model.max_seq_len=4096",
        file="configs/llama-tiny.yaml")
    assert report.experts["experts_per_device"] == 1 and report.experts["all_to_all_bytes"] > 0


@pytest.mark.slow  # loads libtpu's topology
def test_a_mesh_whose_axes_split_the_torus_is_built():
    """data 8 x expert 8 on v5p:4x4x4 matches no product of the torus's 4 x 4 x 4: the mesh is
    still built, an axis over parts of two physical ones (jax.make_mesh alone refuses)."""
    from zjax.runtime.config import MeshConfig
    from zjax.runtime.mesh import make_mesh
    from zjax.runtime.targets import target

    devices = list(target("v5p:4x4x4").devices)
    mesh = make_mesh(MeshConfig(data=-1, expert=8), devices=devices)
    assert dict(mesh.shape) == {"data": 8, "expert": 8, "model": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
