"""What each XLA backend needs from zjax: one frozen record per platform, quirks in one place.

Every backend-specific choice the plan, the step and the gather make is read from the
:class:`Backend` of the mesh's platform, never from a ``platform == "cpu"`` test elsewhere. A
workaround is a :class:`Quirk` with the reason and the bug it works around; CPU workarounds
must never reach GPU or TPU (``tests/test_targets.py`` fails if one leaks).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from jax.sharding import Mesh

__all__ = ["Backend", "Quirk", "backend", "backend_of"]


@dataclasses.dataclass(frozen=True)
class Quirk:
    """A workaround that is on for a backend, and why.

    Attributes:
      reason: what goes wrong without it.
      link: the bug report (or the measurement) behind it.
    """

    reason: str
    link: str


@dataclasses.dataclass(frozen=True)
class Backend:
    """One XLA backend's settings and workarounds (None: the workaround is off).

    Attributes:
      platform: ``cpu``, ``gpu`` or ``tpu`` (``jax.Device.platform``).
      compiler_options: XLA options passed to the train step's ``jax.jit``; each key's reason
        is in ``option_reasons``.
      option_reasons: why each compiler option is set.
      wide_reduce: reduce 16-bit gradients in float32 (the backend cannot compile 16-bit
        reductions).
      join_gathers: join the gathers outside the layer loops with one barrier
        (:func:`zjax.partition.gather.join_gathers`).
      scatter_via_all_reduce: with several processes, reduce-scatter as all-reduce + slice.
      scatter_via_ring: reduce-scatter as a ring of collective-permutes (the compiler runs a
        reduce-scatter as an all-reduce: twice the bytes).
      bucket_layer_gathers: with prefetch, a layer scan moves each layer's sharded leaves as
        one bucket (one all-gather, one reduce-scatter per layer; ``ScheduleSpec.bucket``).
      hoists_loop_casts: the compiler moves the cast of a layer's slice to the gather dtype
        out of the layer loop (converting the whole stack up front and holding that copy);
        the cast is made with a rounding first (``Comm.keep_casts_in_loops``).
      prefetch_before_vjp: the backward of a layer scan waits for its prefetched weights
        before the layer's VJP (``Comm.prefetch_before_vjp``).
      no_host_update: refuse ``zero.offload_optimizer.update_on: host`` (the compiler crashes).
      decomposes_collectives: the compiler writes a reduce-scatter as an all-reduce whose
        result is dynamic-sliced, and a small all-gather as an all-reduce of a zero-padded
        buffer (TPU); :func:`zjax.planning.collective_bytes` then reads them as what they are.
    """

    platform: str
    compiler_options: Mapping[str, str | bool] = dataclasses.field(default_factory=dict)
    option_reasons: Mapping[str, Quirk] = dataclasses.field(default_factory=dict)
    wide_reduce: Quirk | None = None
    join_gathers: Quirk | None = None
    scatter_via_all_reduce: Quirk | None = None
    scatter_via_ring: Quirk | None = None
    bucket_layer_gathers: Quirk | None = None
    hoists_loop_casts: Quirk | None = None
    prefetch_before_vjp: Quirk | None = None
    no_host_update: Quirk | None = None
    decomposes_collectives: bool = False

    def workarounds(self) -> dict[str, Quirk]:
        """The quirks that are on (compiler options by their option name)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), Quirk)}
        return {**out, **{f"compiler_options.{k}": q for k, q in self.option_reasons.items()}}


def _options(**pairs: tuple[str | bool, Quirk]) -> dict:
    return {"compiler_options": types.MappingProxyType({k: v for k, (v, _) in pairs.items()}),
            "option_reasons": types.MappingProxyType({k: q for k, (_, q) in pairs.items()})}


_CPU = Backend(
    platform="cpu",
    **_options(xla_disable_hlo_passes=("cse_barrier_expander", Quirk(
        "XLA:CPU's cse_barrier_expander strips the remat barriers, after which CSE merges the "
        "backward re-gather of a non-Stack leaf (a tied embedding) into its forward gather "
        "and keeps it alive across the step; GPU and TPU do not run the pass and cannot "
        "compile the barriers it would leave (opt-barrier)",
        "measured here: tests/test_collectives_memory.py (temp flat in depth)"))),
    wide_reduce=Quirk(
        "XLA:CPU (jaxlib 0.10) aborts compiling a 16-bit all-reduce or reduce-scatter "
        "('Invalid binary instruction opcode copy' in ChangeOpDataType)",
        "measured here with jaxlib 0.10.2"),
    join_gathers=Quirk(
        "XLA:CPU runs a loop's collectives in an executor of their own, unordered against "
        "those outside; two same-kind collectives in flight share one rendezvous key "
        "(channel id 1) and abort or hang the step",
        "zjax.planning.unordered_collectives; jax-ml/jax#40830 (thread)"),
    scatter_via_all_reduce=Quirk(
        "with jax.distributed, XLA:CPU's gloo reduce-scatter intermittently returns wrong "
        "values at the end of rank 0's chunk, with no error",
        "https://github.com/jax-ml/jax/issues/40830"),
)

_GPU_MEASURED = ("measured here: benchmarks/zero_step.py --target h100:8 --d-model 1024 "
                 "--n-layers 16 --n-heads 8 --batch 64 --seq-len 512 --job J, zjax plan "
                 "configs/{gpt-7b,llama3-8b}.yaml --target h100:8x8")
_GPU = Backend(
    platform="gpu",
    **_options(xla_gpu_enable_cub_radix_sort=(False, Quirk(
        "the CUDA plugin's compiler sizes CUB radix sort's scratch through the CUDA runtime: "
        "without a GPU (a compile-only target) a sort above its size threshold (the dropless "
        "experts' argsort of a device's assignments) fails to compile ('Error loading CUDA "
        "libraries'); XLA's own sort compiles alike with and without the GPU, so a plan is "
        "of the program that runs (a sort of tens of thousands of expert ids per layer)",
        "measured here: zjax plan configs/mixtral-8x7b.yaml --target h100:8x8")),
        xla_gpu_enable_latency_hiding_scheduler=(True, Quirk(
            "MaxText's GPU flag: without it XLA:GPU schedules every collective of a step with "
            "a ragged all-to-all (dropless expert parallelism) right before its use, start "
            "then done (Mixtral on h100:8x8: gathers 0% overlapped, all-to-alls 17%; with "
            "it 100% and 83%)",
            "measured here: zjax plan configs/mixtral-8x7b.yaml --target h100:8x8"))),
    # measured together (temp, stage 3, prefetch 1; none -> bucket -> bucket and barrier):
    # d_model 1024 / 16 layers at 4k tokens per device 532.9 -> 482.6 -> 446.0 MB (bf16
    # reduce 482.5 -> 423.3 -> 395.2; GSPMD FSDP, same kernel, 451.5), at 256 tokens 267.7 ->
    # 213.2 -> 220.0 MB; llama3-8b on h100:8x8 19.36 -> 19.45 -> 19.05 GB, gpt-7b 16.13 ->
    # 15.73 -> 16.14 GB; gathers 100% overlapped and wire bytes unchanged throughout
    bucket_layer_gathers=Quirk(
        "with a layer's leaves gathered and reduce-scattered one by one, XLA:GPU's step "
        "holds 50-60 MB more temp at d_model 1024 (which buffers, its dumps do not say); "
        "one bucket per layer moves the same bytes, as overlapped", _GPU_MEASURED),
    prefetch_before_vjp=Quirk(
        "with the bucket, XLA:GPU keeps the backward's prefetched bucket in flight across "
        "the layer's VJP, where the step peaks, unless it is tied to the VJP's cotangent",
        _GPU_MEASURED),
)

_MAXTEXT = ("MaxText's TPU flags (its README and MaxText/configs): libtpu runs every "
            "collective synchronously without them")
_TPU_FLAGS = {flag: (True, Quirk(_MAXTEXT, "measured here: benchmarks/tpu_flags.py"))
                         for flag in ("xla_tpu_enable_async_collective_fusion",
                                      "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
                                      "xla_tpu_enable_async_collective_fusion_multiple_steps",
                                      "xla_tpu_overlap_compute_collective_tc",
                                      "xla_enable_async_all_gather",
                                      "xla_tpu_enable_async_collective_fusion_fuse_all_reduce",
                                      "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter",
                                      "xla_enable_async_all_reduce")}
# measured on Qwen3-30B-A3B, 4 layers, v5p:4x4x4, data 8 x expert 8: the expert all-to-alls
# overlapped 0% -> 100% (4 of the 6 ragged ones a layer with a matmul in flight; all-gathers
# 30% -> 15%)
_TPU_A2A = {flag: (True, Quirk(
    "libtpu runs all-to-alls (expert parallelism's dispatch and combine) synchronously "
    "unless asked", "measured here: zjax plan configs/qwen3-30b-a3b.yaml --target v5p:4x4x4"))
    for flag in ("xla_tpu_enable_async_all_to_all", "xla_tpu_enable_async_ragged_all_to_all")}
_TPU = Backend(
    platform="tpu",
    decomposes_collectives=True,
    # measured with benchmarks/zero_step.py --target v5p:2x2x2 (d_model 1024, 16 layers):
    # ZeRO gather bytes overlapped with compute 0% -> 43-83% (stage 3, prefetch 0-2); the
    # all-reduce fusion (TPU's reduce-scatter is an all-reduce + slice) 44% -> 61% at prefetch
    # 1, the same 83% at prefetch 0 (benchmarks/tpu_flags.py, which also lists flags that
    # changed nothing and are not set)
    **_options(**_TPU_FLAGS, **_TPU_A2A),
    scatter_via_ring=Quirk(
        "libtpu (v5p, v4, v5e) runs a reduce-scatter as an all-reduce whose result is "
        "sliced: twice the bytes of a reduce-scatter. A ring of n - 1 collective-permutes of "
        "one tile each moves a reduce-scatter's bytes, asynchronously (GSPMD's own TPU "
        "gradient reductions are collective-permutes too). v5p:2x2x2, d_model 1024, 16 "
        "layers, bf16 reduce: stage 3 wire 1641 -> 1237 MB at prefetch 1, 1616 -> 1212 MB "
        "at prefetch 0 (temp +2 MB), stage 2 temp 1498 -> 1432 MB; reduce-scatter bytes "
        "overlapped with compute 0% -> 100%",
        "measured here: benchmarks/zero_step.py --target v5p:2x2x2 --variants"),
    bucket_layer_gathers=Quirk(
        "libtpu runs one asynchronous collective fusion at a time and leaves the gathers it "
        "cannot fit between a layer's ops synchronous; one bucket per layer is hidden "
        "behind the whole previous layer. v5p:2x2x2, d_model 1024, 16 layers, prefetch 1: "
        "gather bytes overlapped 61% -> 97%, temp 811 -> 809 MB (with prefetch_before_vjp; "
        "794 -> 850 MB without it); "
        "prefetch 2: 94%. Without prefetch a bucket cannot overlap (0%), so it is unused",
        "measured here: benchmarks/tpu_flags.py, benchmarks/zero_step.py --target v5p:2x2x2"),
    hoists_loop_casts=Quirk(
        "libtpu moves the float32 -> bfloat16 convert of a layer's slice out of the layer "
        "loops: it converts every stacked shard before the forward and again before the "
        "backward and keeps those copies through both (a second copy of the stack's shards "
        "in bfloat16). A reduce_precision to bfloat16's bits before the convert (same "
        "values) keeps it per layer. v5p:2x2x2, d_model 1024, 16 layers, 4k tokens per "
        "device, bf16 reduce: stage 3 temp 843 -> 793 MB at prefetch 0, 861 -> 809 MB at "
        "prefetch 1 (GSPMD FSDP with bf16 compute: 839 MB). XLA:GPU keeps the convert in the "
        "loop (H100 temp unchanged)",
        "measured here: benchmarks/zero_step.py --target v5p:2x2x2 --variants"),
    prefetch_before_vjp=Quirk(
        "libtpu keeps the backward's prefetch (with the layer bucket: its rows, flat copy "
        "and split leaves) in flight across the layer's VJP, where the step peaks; tied to "
        "the VJP's cotangent, it arrives during the recomputed forward. Stage 3, prefetch "
        "1, bf16 reduce, temp: v5p:2x2x2 d_model 1024, 16 layers, 4k tokens per device "
        "850 -> 809 MB (overlap 97% either way), 256 tokens per device 331 -> 287 MB; the "
        "7B template on v5p:4x4x4 42.66 -> 42.49 GB, d_model 768 (8 layers, 4k tokens) 382 "
        "-> 364 MB; with every leaf sharded (zero.param_persistence_threshold 0: "
        "benchmarks/tpu_quirk.py) d_model 2048 (4 layers, 4k tokens) 1377 -> 1294 MB, but "
        "d_model 768 355 -> 392 MB. On H100 alone it was mixed (623 -> 603 MB at d_model "
        "1024, 4k tokens; 242 -> 258 MB at 256 tokens); with the layer bucket the GPU "
        "record sets it too (its own measurement)",
        "measured here: benchmarks/zero_step.py --target T --variants, zjax plan "
        "configs/gpt-7b.yaml --target T, benchmarks/tpu_quirk.py"),
    no_host_update=Quirk(
        "libtpu 0.0.42 cannot compile an optimizer update placed on the host with "
        "compute_on('device_host'): SIGILL in xla::HostOffloader::WalkDownHostMemoryOffloadPaths "
        "or 'The async-start expects the async shape ... to match the async computation root "
        "shape' after optimization",
        "measured here: libtpu 0.0.42.1, v5p:2x2x2 deviceless compile, configs/tiny-offload.yaml"),
)

_BACKENDS = {"cpu": _CPU, "gpu": _GPU, "cuda": _GPU, "rocm": _GPU, "tpu": _TPU}


def backend(platform: str) -> Backend:
    """The record of ``platform`` (``cpu``, ``gpu``/``cuda``/``rocm``, ``tpu``)."""
    try:
        return _BACKENDS[platform]
    except KeyError:
        raise ValueError(f"no zjax backend record for platform {platform!r}; known: "
                         f"{', '.join(sorted(_BACKENDS))}") from None


def backend_of(mesh: Mesh) -> Backend:
    """The record of the platform of ``mesh``'s devices."""
    return backend(mesh.devices.flat[0].platform)


