"""The step on real accelerator compilers: H100 (CUDA plugin) and TPU v5p (libtpu), deviceless.

Nothing runs on an accelerator: each step is lowered from ShapeDtypeStructs and compiled for
the target's compile-only devices, and the figures are the real compiler's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, TARGET_BASE, cli_env, compiled_for, run_zjax, sharded_params, zjax_main

import zjax
from zjax.planning import collective_bytes, compiled_memory
from zjax.planning._flops import peak_flops
from zjax.runtime._backend import backend
from zjax.runtime.targets import target

GPU, TPU = "h100:8", "v5p:2x2x2"
SETTINGS = {
    "stage0": ["zero.stage=0"],
    "stage1": ["zero.stage=1"],
    "stage2": ["zero.stage=2"],
    "stage3-prefetch0": ["zero.stage=3", "zero.prefetch_layers=0", "zero.reduce_dtype=float32"],
    "stage3-prefetch1": ["zero.stage=3", "zero.prefetch_layers=1", "zero.reduce_dtype=float32"],
    "stage3-tp": ["zero.stage=3", "mesh.data=4", "mesh.model=2"],
}


_compiled = compiled_for
_sharded_params = sharded_params


def test_accelerator_records_hold_no_cpu_workaround():
    cpu = backend("cpu")
    assert cpu.workarounds(), "the CPU record lost its workarounds"
    for platform in ("gpu", "cuda", "tpu"):
        record = backend(platform)
        leaked = set(record.workarounds()) & set(cpu.workarounds())
        assert not leaked, f"{platform} carries CPU workarounds {leaked}"
        assert not set(record.compiler_options) & set(cpu.compiler_options)
    # the GPU record's two are measured memory choices (zjax/runtime/_backend.py), not workarounds
    # of a CPU bug; one option keeps large sorts compilable without a GPU, the other turns on
    # the latency-hiding scheduler (MaxText's flag) that a ragged all-to-all otherwise loses
    assert set(backend("gpu").workarounds()) == {
        "bucket_layer_gathers", "prefetch_before_vjp",
        "compiler_options.xla_gpu_enable_cub_radix_sort",
        "compiler_options.xla_gpu_enable_latency_hiding_scheduler"}
    tpu = {k for k in backend("tpu").workarounds() if not k.startswith("compiler_options.")}
    assert tpu == {"no_host_update", "bucket_layer_gathers", "scatter_via_ring",
                   "hoists_loop_casts", "prefetch_before_vjp"}
    # TPU's options are the async-collective flags that make gathers overlap (measured)
    assert all("async" in k or "overlap" in k for k in backend("tpu").compiler_options)


@pytest.mark.parametrize("name", [GPU, TPU])
def test_targets_are_compile_only_devices_of_their_chip(name):
    t = target(name)
    assert len(t.devices) == 8 and t.platform == t.devices[0].platform
    assert t.device_kind == ("NVIDIA H100 80GB HBM3" if name == GPU else "TPU v5")
    assert t.capacity_bytes == (84942979072 if name == GPU else 95 * 10**9)
    assert target("h200:8").capacity_bytes == 151397597184
    assert target("h100:2x4").hosts == 2 and len(target("h100:2x4").devices) == 8


@pytest.mark.parametrize("bad, why", [("h10:8", "did you mean 'h100'"), ("h100:x", "GPU count"),
                                      ("v5p:3x3", "not a v5p topology"), ("", "no known chip")])
def test_unknown_targets_are_config_errors(bad, why):
    with pytest.raises(zjax.ConfigError, match=why):
        target(bad)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", [GPU, TPU])
def test_every_stage_compiles_and_plans_the_compiled_memory(name, setting):
    zstep, compiled, r = _compiled(name, *SETTINGS[setting])
    mem = compiled.memory_analysis()
    # compiling at all shows no CPU option leaked (GPU/TPU cannot compile opt-barrier)
    assert zstep.plan.backend is backend(target(name).platform)
    assert r.per_device["temp_bytes"] == mem.temp_size_in_bytes
    assert r.per_device["total_bytes"] == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                           + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    assert r.setting["target"] == name and r.fits_device is True
    assert r.per_device["capacity_bytes"] == target(name).capacity_bytes


@pytest.mark.slow
@pytest.mark.parametrize("reduce_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("name", ["cpu", GPU, TPU])
def test_stage3_moves_two_gathers_and_one_reduce_scatter_per_parameter(name, prefetch,
                                                                      reduce_dtype):
    zstep, compiled, _ = _compiled(name, "zero.stage=3", f"zero.prefetch_layers={prefetch}",
                                   f"zero.reduce_dtype={reduce_dtype}")
    coll = collective_bytes(compiled.as_text(), decomposed=name == TPU)
    psi = _sharded_params(zstep)
    # bf16 gathers; the reduce in the configured dtype, except on XLA:CPU (float32 only)
    reduced = np.dtype("float32" if name == "cpu" else reduce_dtype).itemsize
    # 2 x Psi, and prefetch k gathers k layers past the stack's end (the backward's drain)
    drain = prefetch * _sharded_params(zstep, layer=True)
    assert coll.all_gather == pytest.approx((2 * psi + drain) * 2, rel=0.02)
    assert coll.reduce_scatter == pytest.approx(psi * reduced, rel=0.02)
    assert coll.all_reduce < 0.01 * psi  # scalars (loss, count, grad norm) only
    # no reduce-scatter run as an all-reduce (TPU: the ring of Backend.scatter_via_ring);
    # libtpu still runs gathers this small as all-reduces of zero-padded buffers
    assert coll.reduce_scatter_via_all_reduce == 0


@pytest.mark.slow
def test_a_bf16_reduce_keeps_the_stacks_gradient_shards_in_bf16_until_the_loop_ends():
    """The backward writes each layer's gradient shards into a bfloat16 stack, cast once
    after the loop: no float32 stack of them is written (half the buffer; d_model 1024,
    16 layers on H100: temp 532.9 -> 482.5 MB at a bf16 reduce)."""
    zstep, compiled, _ = _compiled(GPU, "zero.stage=3", "zero.prefetch_layers=1",
                                   "zero.reduce_dtype=bfloat16")
    hlo, plan = compiled.as_text(), zstep.plan
    written = {"bf16": 0, "f32": 0}
    for leaf in plan.leaves:
        if leaf.dim is None or not leaf.stacked:
            continue
        shape = [n // plan.n_shard if d == leaf.dim else n for d, n in enumerate(leaf.shape)]
        for dtype in written:
            pattern = rf"{dtype}\[{','.join(map(str, shape))}\]\S* dynamic-update-slice\("
            written[dtype] += len(re.findall(pattern, hlo))
    assert written["bf16"] > 0 and written["f32"] == 0, written


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(8, 1), (4, 2)])
@pytest.mark.parametrize("name", ["cpu", GPU, TPU])
def test_llama_stage3_compiles_plans_and_moves_two_gathers_per_parameter(name, mesh):
    """The Llama (grouped-query attention, rotary, SwiGLU) on all three compilers, with and
    without tensor parallelism: plan memory is the compiler's, gathers 2 x Psi (+ the drain,
    - the head),
    reduce-scatters Psi (bf16 on accelerators), overlapped on GPU and TPU (at d_model 512)."""
    zstep, compiled, planned = _compiled(
        name, "zero.prefetch_layers=1", "zero.reduce_dtype=bfloat16", f"mesh.data={mesh[0]}",
        f"mesh.model={mesh[1]}", file="configs/llama-tiny.yaml")
    assert planned.per_device["temp_bytes"] == compiled.memory_analysis().temp_size_in_bytes
    coll = collective_bytes(compiled.as_text(), decomposed=name == TPU,
                            mesh_axes=dict(zstep.plan.mesh.shape))
    # per device: 1/model of each split leaf moves over data
    psi = sum(leaf.size // (mesh[1] if leaf.model_dim is not None else 1)
              for leaf in zstep.plan.leaves if leaf.dim is not None)
    layer = sum(leaf.size // leaf.shape[0] // (mesh[1] if leaf.model_dim is not None else 1)
                for leaf in zstep.plan.leaves if leaf.dim is not None and leaf.stacked)
    # the untied head is used last in the forward and first in the backward: the compilers
    # keep its one gather (the re-gather would follow it at once), so it moves once
    head = zstep.plan.leaves_by_path["head"].size
    over_data = coll.by_axis["data"]
    reduced = 4 if name == "cpu" else 2
    assert over_data["all_gather"] == pytest.approx((2 * psi + layer - head) * 2, rel=0.02)
    assert over_data["reduce_scatter"] == pytest.approx(psi * reduced, rel=0.02)
    if name != "cpu" and mesh == (8, 1):  # layers big enough to overlap (as for the GPT)
        *_, wide = _compiled(name, "zero.prefetch_layers=1", "model.d_model=512",
                             "model.d_ff=1376", "model.n_layers=4",
                             file="configs/llama-tiny.yaml")
        assert wide.overlap["all_gather"] >= 0.85, wide.overlap
        assert wide.overlap["reduce_scatter"] >= 0.9, wide.overlap


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu", GPU, TPU])
def test_stage2_reduce_scatters_grads_and_gathers_the_working_copy(name):
    zstep, compiled, _ = _compiled(name, "zero.stage=2")
    coll = collective_bytes(compiled.as_text(), decomposed=name == TPU)
    psi = _sharded_params(zstep)
    assert coll.reduce_scatter == pytest.approx(psi * 4, rel=0.02)  # float32 reduce
    assert coll.all_gather == pytest.approx(psi * 2, rel=0.02)  # the bf16 working copy


@pytest.mark.slow
def test_accelerators_overlap_the_zero_collectives_with_compute_and_cpu_cannot():
    # layers big enough that XLA's latency-hiding scheduler finds the overlap worth it
    wide = ("zero.stage=3", "zero.prefetch_layers=1", "model.d_model=512", "model.d_ff=2048",
            "model.n_layers=4")
    *_, gpu = _compiled(GPU, *wide)
    *_, cpu = _compiled("cpu", *SETTINGS["stage3-prefetch1"])
    *_, tpu = _compiled(TPU, *wide)
    assert gpu.overlap["all_gather"] >= 0.9 and gpu.overlap["reduce_scatter"] >= 0.9
    assert cpu.overlap["all_gather"] == 0 and cpu.overlap["reduce_scatter"] == 0
    # libtpu overlaps gathers only with the async-collective flags of zjax's TPU record (0%
    # without them), and with prefetch the whole of a layer's only with one bucket per layer
    # (Backend.bucket_layer_gathers: 11% here without it; the rest is outside the loops)
    assert tpu.overlap["all_gather"] >= 0.85, tpu.overlap  # 88%; 97% at d_model 1024
    # the ring's collective-permutes (Backend.scatter_via_ring) run behind compute, after the
    # prefetch (44% of gather bytes overlapped without the barrier in the backward loop)
    assert tpu.overlap["reduce_scatter"] >= 0.9, tpu.overlap


OFFLOAD = {
    "optimizer": ["zero.offload_optimizer.device=host"],
    "param": ["zero.offload_param.device=host"],
    "both": ["zero.offload_optimizer.device=host", "zero.offload_param.device=host"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["h100:2x4", TPU])
def test_hpz_compiles_and_keeps_the_backward_gathers_on_the_host(name):
    """ZeRO++'s hierarchical partition over each host's 4 devices on CUDA's compiler (2 hosts
    of 4 GPUs) and libtpu (v5p:2x2x2, whose 2 hosts the mesh interleaves along data until
    the plan puts the axis in process order): the forward's gathers across hosts carry a
    quarter of a weight per device, the backward's stay on the host; the gradients cross
    hosts at their second level only (a quarter of the first's bytes)."""
    zstep, _, rep = _compiled(name, "zero.stage=3", "zero.hpz_partition_size=4",
                              "zero.reduce_dtype=float32")
    assert zstep.plan.n_node == 2
    inter, intra = rep.collectives_by_link["inter_host"], rep.collectives_by_link["intra_host"]
    assert 0 < inter["all_gather"] < intra["all_gather"] / 3
    # a quarter, and on GPU (per leaf) one more layer: the first backward iteration's zeros
    layers = 2  # TARGET_BASE
    assert 0 < inter["reduce_scatter"] <= intra["reduce_scatter"] * (layers + 1) / layers / 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(OFFLOAD))
def test_offload_compiles_on_tpu_with_host_bytes_from_the_compiler(mode):
    _, compiled, r = _compiled(TPU, "zero.stage=3", *OFFLOAD[mode])
    mem = compiled.memory_analysis()
    assert r.per_device["host_bytes"] > 0
    # TPU counts host arguments apart: the plan's host bytes are the compiler's
    assert mem.host_argument_size_in_bytes == r.per_device["host_bytes"]
    assert r.per_device["total_bytes"] == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                           + mem.temp_size_in_bytes - mem.alias_size_in_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", [GPU, TPU])
def test_nvme_optimizer_plans_on_accelerators_with_the_state_off_the_device(name):
    """With the optimizer on NVMe the compiled program is the gradient step: the device holds
    bfloat16 param shards (its arguments) and no optimizer state; the master and Adam's
    moments (12 bytes a parameter over 8 devices) are planned on NVMe. Planning for another
    machine does not touch its ``nvme_path``. (Its temporaries are not smaller: on H100 the
    tiny model's are 0.55 MB larger than the in-memory step's, whose 12 bytes a parameter
    of state are 0.6 MB here.)"""
    nvme = ["zero.stage=3", "zero.offload_optimizer.device=nvme",
            "zero.offload_optimizer.nvme_path=/nonexistent/nvme"]
    zstep, compiled, r = _compiled(name, *nvme)
    _, _, memory = _compiled(name, "zero.stage=3")
    n_params = sum(leaf.size for leaf in zstep.plan.leaves)
    assert r.per_device["nvme_bytes"] == 12 * n_params // 8
    assert r.per_device["params_bytes"] * 2 == memory.per_device["params_bytes"]
    assert r.per_device["optimizer_bytes"] == r.per_device["nvme_bytes"]
    assert compiled.memory_analysis().argument_size_in_bytes < r.per_device["params_bytes"] + 2**16
    assert r.per_device["total_bytes"] == compiled_memory(compiled)["peak_bytes"]


@pytest.mark.parametrize("name, overrides, match", [
    (TPU, ["zero.offload_optimizer.device=host", "zero.offload_optimizer.update_on=host"],
     "update_on: host cannot compile on tpu"),
    (GPU, OFFLOAD["optimizer"], "compile-only devices of a deviceless GPU target"),
    (GPU, OFFLOAD["param"], "compile-only devices of a deviceless GPU target"),
])
def test_offload_the_compiler_cannot_take_is_refused_beforehand(name, overrides, match):
    with pytest.raises(zjax.ConfigError, match=match):
        _compiled(name, "zero.stage=3", *overrides)


@pytest.mark.slow
def test_plan_cli_with_a_target_and_a_bad_one():
    r = zjax_main("plan", "configs/tiny.yaml", "--target", GPU, "model.n_layers=2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["setting"]["target"] == GPU and out["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert out["per_device"]["capacity_bytes"] == 84942979072 and out["fits_device"] is True
    assert out["overlap"]["all_gather"] >= 0.9
    bad = zjax_main("plan", "--target", "v9z:2x2")
    assert bad.returncode == 2 and "zjax: error: --target: 'v9z:2x2'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_step_over_the_chip_memory_does_not_fit():
    """libtpu refuses to compile a program over its HBM (RESOURCE_EXHAUSTED): the plan says
    it does not fit, with the compiler's figures, instead of a traceback (the autotuner then
    counts the candidate as one that cannot be built)."""
    config = zjax.load_config("configs/tiny.yaml", [
        "model.n_layers=2", "model.max_seq_len=32768", "data.seq_len=32768",
        "data.batch_size=64", "model.attention=dense"])  # 32768^2 float32 scores per head
    with pytest.raises(zjax.ConfigError, match=r"^--target v5p:2x2x2: does not fit: .*HLO "
                                               r"temporaries \(\d.*exceeds available HBM"):
        zjax.plan(config, target=TPU)


@pytest.mark.slow
def test_cli_simulates_cpu_devices_with_the_compiler_plugins_installed():
    # subprocess: a fresh shell's environment is what is tested (jax started by the CLI)
    # a fresh shell: no XLA_FLAGS, no JAX_PLATFORMS; the CUDA plugin and libtpu are installed
    env = cli_env(PJRT_NPROC=None, XLA_FLAGS=None)
    r = run_zjax("plan", "configs/tiny.yaml", "model.n_layers=2", "--json", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["n_devices"] == 8 and out["device_kind"] == "cpu"


def test_model_flops_count_the_heads_width_and_the_windowed_layers():
    """Gemma-2-9B: 16 heads of 256 (4096, not d_model 3584); 21 of its 42 layers attend
    through 4096 of the 8192 positions."""
    from zjax.planning._flops import flops_per_token
    from zjax.task import flops_shape

    config = zjax.load_config("configs/gemma-2-9b.yaml", ["data.path="])
    shape = flops_shape(config)["model_shape"]
    assert shape == {"n_layers": 42, "d_model": 3584, "seq_len": 8192, "attn_width": 4096,
                     "window": 4096, "windowed_layers": 21}
    assert flops_per_token(1, **shape) == 6 + 12 * 4096 * (21 * 8192 + 21 * 4096)
    assert flops_per_token(1, **{**shape, "seq_len": 2048}) == 6 + 12 * 4096 * 42 * 2048


def test_model_flops_and_the_peak_of_every_targets_chip():
    """Every target's chip has a bf16 peak (the device_kind strings match the table), and the
    plan's model FLOPs are 6N + 12 L d T per token (PaLM's MFU numerator)."""
    for name in ("h100:8", "h200:8", TPU, "v5e:2x2", "v6e:2x4", "v4:2x2x1"):
        assert peak_flops(target(name).device_kind), name
    config = zjax.load_config("configs/tiny.yaml", list(TARGET_BASE))
    report = zjax.plan(config, target=GPU)
    m = config.model
    per_token = 6 * report.n_params + 12 * m.n_layers * m.d_model * config.data.seq_len
    assert report.flops["per_token"] == per_token
    assert report.flops["per_step"] == per_token * config.data.batch_size * config.data.seq_len
    assert report.flops["step_s_at_peak"] == pytest.approx(
        report.flops["per_step"] / (989.4e12 * 8))
    assert "model FLOPs per step" in report.table()
    assert peak_flops("cpu") is None  # simulated devices: no MFU


# a fresh interpreter (libtpu starts once per process: its start-up lines come only the first
# time), jax imported with fd 2 on /dev/null: the CUDA plugin's own import-time lines
# (cudart_stub) are not libtpu's and not what this checks; everything after is on stderr
_FRESH = ("import os, sys\n"
          "null, saved = os.open(os.devnull, os.O_WRONLY), os.dup(2)\n"
          "os.dup2(null, 2)\n"
          "import jax\n"
          "os.dup2(saved, 2)\n")


def _fresh(code: str) -> subprocess.CompletedProcess:
    # subprocess: libtpu's start-up lines on fd 2 come only in a process that first loads it
    return subprocess.run([sys.executable, "-c", _FRESH + code], cwd=ROOT,
                          env=cli_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=120)


def test_impossible_tpu_topologies_print_only_zjax_s_error_line():
    """libtpu writes start-up lines to fd 2 (``Failed to find host bounds``, ``E0000 ...
    unexpected worker hostname``) the first time it loads, before zjax's own error."""
    bad = ["v5p:1x1", "v5p:3x3x3", "v5p:0x1x1", "v5e:3x3"]
    r = _fresh("from zjax import cli\n"
               f"for t in {bad!r}:\n"
               "    print('--- ' + t, file=sys.stderr, flush=True)\n"
               "    print(cli.main(['plan', 'configs/tiny.yaml', '--target', t]), flush=True)\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["2"] * len(bad), (r.stdout, r.stderr[-3000:])
    chunks = r.stderr.split("--- ")[1:]
    assert len(chunks) == len(bad), r.stderr[-3000:]
    for name, chunk in zip(bad, chunks, strict=True):
        lines = chunk.rstrip("\n").split("\n")
        assert lines[0] == name, r.stderr[-3000:]
        # nothing but zjax's one line: no E0000/W0000/I0000 log line, no libtpu warning
        assert len(lines) == 2 and lines[1].startswith(f"zjax: error: --target: '{name}' "), (
            r.stderr[-3000:])
    assert "at least 1" in chunks[2], chunks[2]  # refused before libtpu is asked


def test_a_valid_tpu_target_starts_libtpu_quietly():
    r = _fresh("from zjax.runtime.targets import target\n"
               "t = target('v5p:2x2x2')\n"
               "print(len(t.devices), t.hosts)\n")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["8", "2"] and r.stderr == "", r.stderr[-3000:]
