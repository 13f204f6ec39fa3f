"""The ``zero`` config section: what DeepSpeed calls ``zero_optimization``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from zjax.errors import ConfigError, did_you_mean
from zjax.offload.config import OffloadConfig, OptimizerOffloadConfig
from zjax.schema import choices, non_negative, positive, validate

__all__ = ["DTYPES", "ZeroConfig", "resolve_dtype"]

DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(name: str, *, key: str) -> np.dtype:
    """Map a dtype name from a config to a numpy dtype, naming ``key`` if it is not allowed."""
    if name not in DTYPES:
        raise ConfigError(
            f"{key}: unknown dtype {name!r}{did_you_mean(name, DTYPES)}; "
            f"choose one of {', '.join(DTYPES)}"
        )
    return np.dtype(getattr(jnp, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """ZeRO placement and scheduling options.

    Attributes:
      stage: 0 replicates everything (DDP); 1 shards optimizer state; 2 also reduce-scatters
        gradients; 3 also shards parameters and gathers them on use.
      param_persistence_threshold: leaves (per layer, for stacked leaves) with fewer elements
        stay replicated and their gradients are all-reduced (DeepSpeed
        ``stage3_param_persistence_threshold``).
      gather_dtype: dtype of the working weights: every parameter all-gather moves this dtype
        and the model computes in it. At stages 0-2 the replicated working copy is stored in it.
      reduce_dtype: dtype in which gradients are reduce-scattered / all-reduced; they are
        accumulated in float32 whatever this is.
      prefetch_layers: how many layers ahead the scheduled layer scan gathers (0 = gather
        just before use). Mutually exclusive with ``prefetch_bucket_size``.
      prefetch_bucket_size: prefetch budget in bytes of gathered weights (DeepSpeed
        ``stage3_prefetch_bucket_size``); converted to whole layers.
      max_live_parameters: cap on gathered parameter elements alive at once (DeepSpeed
        ``stage3_max_live_parameters``); lowers the prefetch depth if needed.
      offload_optimizer: optimizer state in host memory between steps (stages 1-3), and
        optionally the update run on the host (DeepSpeed ``offload_optimizer``); or, with
        ``device: nvme``, the float32 master and the optimizer state in swap files, updated
        on the host by streamed sub-groups (ZeRO-Infinity, :mod:`zjax.offload.nvme`).
      offload_param: float32 master params in host memory between steps (DeepSpeed
        ``offload_param``): at stage 3 each layer's shard is brought in as it is gathered;
        at stages 1-2 the master is brought in for the update only.
      quantized_weights: ZeRO++'s qwZ (DeepSpeed ``zero_quantized_weights``): stage 3 gathers
        each weight shard as blockwise int8 with a float32 scale per block (symmetric, absmax),
        dequantized to ``gather_dtype`` after the gather; gradients are unchanged (the
        backward reduce-scatters the full-precision cotangent). About half a bf16 gather's
        bytes, a quarter of a float32 one's.
      fp8_gather: with ``model.fp8``, stage 3 gathers the weights of the FP8 projections in
        ``float8_e4m3fn``: each weight's shard scaled by the weight's global absolute maximum
        (a scalar maximum over the mesh as it is gathered), gathered as one byte an element,
        and fed with that scale to the FP8 GEMMs as it is (never widened to
        ``gather_dtype``). About half a bf16 gather's bytes;
        gradients are unchanged. Other leaves (embeddings, head, norms, router, experts)
        gather as before.
      quantized_gradients: ZeRO++'s qgZ (DeepSpeed ``zero_quantized_gradients``): gradients
        of sharded leaves reduce-scattered as blockwise int8 through an all-to-all, summed
        in float32 on arrival (stages 2-3): about a quarter of a float32 reduce-scatter's bytes.
        With ``hpz_partition_size``, in two levels: within the node, then across nodes.
      hpz_partition_size: ZeRO++'s hpZ (DeepSpeed ``zero_hpz_partition_size``), stage 3:
        the devices of a node (k). Params stay sharded over all of ``data``; the layer scan's
        forward gathers each weight across nodes into a 1/k slice (its secondary partition,
        kept for the backward: 2 Psi / k bytes in a 16-bit ``gather_dtype``), then within the
        node; the backward re-gathers within the node only. Gradients are reduce-scattered
        within the node, then across nodes. 1 turns it off.
      sub_group_size: elements of the master that the NVMe optimizer reads, updates and
        writes at once (DeepSpeed ``sub_group_size``); host memory holds about
        ``2 x buffer_count`` of them per state array.
      quantize_block: elements per quantization block of ``quantized_weights`` and
        ``quantized_gradients`` (the scale overhead is 4 bytes per block, 2 in bfloat16).
      quantize_scale_dtype: dtype of the blocks' scales, ``float32`` or ``bfloat16``
        (rounded up, so a block's largest element still fits in 127 steps: its step is up
        to 1/128 coarser).
      offload_activations: ZeRO-R's CPU checkpointing (DeepSpeed ``activation_checkpointing.
        cpu_checkpointing``), any stage: the layer inputs the backward recomputes from live in
        host memory (``pinned_host``) between the forward and the backward, one layer's
        brought back at a time.
      partition_activations: ZeRO-R's partitioned activations (DeepSpeed
        ``activation_checkpointing.partition_activations``), any stage, with ``mesh.model`` > 1:
        each device keeps ``1/model`` of every saved layer input (they are replicated over
        ``model``), all-gathered over ``model`` when the backward reaches the layer.
    """

    stage: int = choices(0, 1, 2, 3, default=3)
    param_persistence_threshold: int = non_negative(4096)
    gather_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    prefetch_layers: int | None = non_negative(None)
    prefetch_bucket_size: int | None = non_negative(None)
    max_live_parameters: int | None = positive(None)
    offload_optimizer: OptimizerOffloadConfig = dataclasses.field(
        default_factory=OptimizerOffloadConfig)
    offload_param: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    quantized_weights: bool = False
    fp8_gather: bool = False
    quantized_gradients: bool = False
    hpz_partition_size: int = positive(1)
    sub_group_size: int = positive(1 << 24)
    quantize_block: int = positive(256)
    quantize_scale_dtype: str = choices("float32", "bfloat16", default="float32")
    offload_activations: bool = False
    partition_activations: bool = False

    def __post_init__(self):
        validate(self, "zero")
        resolve_dtype(self.gather_dtype, key="zero.gather_dtype")
        resolve_dtype(self.reduce_dtype, key="zero.reduce_dtype")
        for key in ("offload_optimizer", "offload_param"):
            section = getattr(self, key)
            if self.stage == 0 and (section.enabled or section.nvme):
                raise ConfigError(
                    f"zero.{key}.device: {section.device} needs a sharded state (stage 1, 2 "
                    "or 3), but zero.stage is 0; raise zero.stage or set the device to none")
        self._check_nvme_params()
        if self.quantized_weights and self.stage < 3:
            raise ConfigError(f"zero.quantized_weights: quantizes stage 3's weight gathers, "
                              f"but zero.stage is {self.stage}; set zero.stage: 3")
        self._check_fp8_gather()
        if self.quantized_gradients and self.stage < 2:
            raise ConfigError(f"zero.quantized_gradients: quantizes the gradients' "
                              f"reduce-scatter (stages 2-3), but zero.stage is {self.stage}; "
                              "set zero.stage: 2 or 3")
        if self.hpz_partition_size > 1 and self.stage < 3:
            raise ConfigError(f"zero.hpz_partition_size: {self.hpz_partition_size} partitions "
                              f"stage 3's gathered weights, but zero.stage is {self.stage}; "
                              "set zero.stage: 3 or zero.hpz_partition_size: 1")
        if self.prefetch_layers is not None and self.prefetch_bucket_size is not None:
            raise ConfigError(
                "zero.prefetch_layers and zero.prefetch_bucket_size both set "
                f"({self.prefetch_layers}, {self.prefetch_bucket_size}); set only one"
            )

    def _check_fp8_gather(self) -> None:
        """FP8 gathers: stage 3's scheduled gathers, none of the other gather formats."""
        if not self.fp8_gather:
            return
        for bad, why in ((self.stage < 3, f"zero.stage is {self.stage}; set zero.stage: 3"),
                         (self.quantized_weights, "zero.quantized_weights (int8 gathers) is "
                                                  "set too; choose one"),
                         (self.hpz_partition_size > 1, "zero.hpz_partition_size "
                                                       f"{self.hpz_partition_size} is not "
                                                       "built with it; set it to 1"),
                         (self.offload_param.nvme, "zero.offload_param.device: nvme streams "
                                                   "its own layers; not built with it")):
            if bad:
                raise ConfigError(f"zero.fp8_gather: gathers stage 3's FP8 weights in FP8, "
                                  f"but {why}")

    def _check_nvme_params(self) -> None:
        """Parameters on NVMe: stage 3's streamed step, over the NVMe optimizer's files."""
        param = self.offload_param
        if not param.nvme:
            return
        if self.stage != 3:
            raise ConfigError(
                f"zero.offload_param.device: nvme streams stage 3's parameter shards layer by "
                f"layer, but zero.stage is {self.stage}; set zero.stage: 3")
        if not self.offload_optimizer.nvme:
            raise ConfigError(
                "zero.offload_param.device: nvme needs zero.offload_optimizer.device: nvme "
                f"(got {self.offload_optimizer.device!r}): the streamed step reads each layer "
                "from the optimizer's float32 master in the swap files and updates it there")
        if param.nvme_path and param.nvme_path != self.offload_optimizer.nvme_path:
            raise ConfigError(
                f"zero.offload_param.nvme_path: {param.nvme_path!r} differs from "
                f"zero.offload_optimizer.nvme_path {self.offload_optimizer.nvme_path!r}: the "
                "parameters are read from the optimizer's master, so both live on one path; "
                "set them equal (or leave offload_param.nvme_path out)")

    @property
    def gather(self) -> np.dtype:
        return resolve_dtype(self.gather_dtype, key="zero.gather_dtype")

    @property
    def reduce(self) -> np.dtype:
        return resolve_dtype(self.reduce_dtype, key="zero.reduce_dtype")

    def prefetch_depth(self, *, layer_elements: int, n_layers: int) -> int:
        """Resolve the prefetch options into a layer count for a stack.

        Args:
          layer_elements: parameter elements of one gathered layer.
          n_layers: layers in the stack (the depth never exceeds ``n_layers // 2``: each step
            gathers ``depth`` layers more than the stack needs, the backward's prefetches past
            layer 0).
        """
        if self.prefetch_layers is not None:
            depth = self.prefetch_layers
        elif self.prefetch_bucket_size is not None:
            layer_bytes = max(1, layer_elements * self.gather.itemsize)
            depth = self.prefetch_bucket_size // layer_bytes
        else:
            depth = 1
        if self.max_live_parameters is not None:
            # backward holds (2 + depth) gathered layers: the one in use, its recompute, prefetch
            depth = min(depth, self.max_live_parameters // max(1, layer_elements) - 2)
        return int(max(0, min(depth, n_layers // 2)))
