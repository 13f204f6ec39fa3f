"""A DeepSpeed ``ds_config.json`` read as zjax config overrides.

Every key is mapped to a zjax key, or ignored with the reason (it has no meaning under XLA, or
zjax always does it), or refused with a ConfigError naming it (an unknown key, a feature zjax
does not have, an impossible value). Hugging Face Trainer's ``"auto"`` values keep zjax's
defaults. The file is read as DeepSpeed reads it (hjson: comments, trailing commas, no key
twice; see ``_ds_file``).

Numbers are checked as they are read (``_number``): a boolean is not a number, ``NaN`` and
``Infinity`` are refused (Python's json reads them as floats, hjson as the strings ``'NaN'`` or
``'NaN,'``), and a key that counts (batch sizes, steps, stage, buffers, thresholds) takes an
integer: ``2.0`` is 2, ``2.5`` is refused rather than truncated.
"""

from __future__ import annotations

import dataclasses
import json

from zjax.config._ds_file import read_deepspeed
from zjax.config._ds_moe import moe
from zjax.config._ds_reader import Reader, auto, number, object_of
from zjax.errors import ConfigError, did_you_mean

__all__ = ["DeepSpeedImport", "from_deepspeed", "read_deepspeed"]

_ALWAYS = "zjax always does this"
# zero_optimization keys with no zjax knob: why
_ZERO_IGNORED = {
    "contiguous_gradients": f"{_ALWAYS} (XLA allocates gradients in its own buffers)",
    "overlap_comm": f"{_ALWAYS} (the schedule prefetches; the compiler overlaps collectives)",
    "reduce_scatter": f"{_ALWAYS} (gradients are reduce-scattered from stage 2)",
    "allgather_partitions": f"{_ALWAYS} (one all-gather per layer or leaf)",
    "allgather_bucket_size": "XLA sizes its collectives; zjax moves a layer at a time",
    "reduce_bucket_size": "XLA sizes its collectives; zjax reduce-scatters a layer at a time",
    "round_robin_gradients": "no CPU-offload gradient copy loop to reorder under XLA",
    "stage3_max_reuse_distance": "each layer is gathered for its use and again for the "
                                 "backward; XLA frees a gathered layer after its last use",
    "stage3_gather_16bit_weights_on_model_save": "`zjax export` always writes gathered weights",
    "stage3_gather_fp16_weights_on_model_save": "`zjax export` always writes gathered weights",
    "gather_16bit_weights_on_model_save": "`zjax export` always writes gathered weights",
    "elastic_checkpoint": "zjax checkpoints restore on any device count",
    "ignore_unused_parameters": "a leaf the loss does not use gets a zero gradient",
    "log_trace_cache_warnings": "zjax traces the loss once; nothing is cached per module",
    "memory_efficient_linear": "XLA fuses the linear layers",
    "legacy_stage1": "one stage-1 implementation",
    "cpu_offload": "use offload_optimizer",
}
_OFFLOAD_IGNORED = {
    "buffer_size": "no staging buffers: JAX moves arrays by memory kind",
    "max_in_cpu": "every offloaded leaf lives in host memory",
    "fast_init": "optimizer state is created in its place (sharded, in host memory)",
    "pipeline_read": "the NVMe optimizer always reads ahead (buffer_count sub-groups)",
    "pipeline_write": "the NVMe optimizer always writes behind (buffer_count sub-groups)",
    "pipeline": "the NVMe optimizer always overlaps reads, updates and writes",
    "ratio": "the whole optimizer state is offloaded",
}
_TOP_IGNORED = {
    "wall_clock_breakdown": "zjax logs step time and tokens/s",
    "zero_allow_untested_optimizer": "any optax optimizer is allowed",
    "prescale_gradients": "zjax divides the gradient sums by the global token count",
    "gradient_predivide_factor": "zjax divides the gradient sums by the global token count",
    "memory_breakdown": "`zjax plan` reports the compiled step's memory",
    "dump_state": "`zjax config show` prints the resolved config",
    "flops_profiler": "not in zjax", "comms_logger": "`zjax plan` reports collective bytes",
    "tensorboard": "set logging.tensorboard", "wandb": "not in zjax",
    "csv_monitor": "metrics.jsonl", "checkpoint": "set checkpoint.*",
    "aio": "NVMe only", "data_types": "set zero.reduce_dtype",
    "seq_parallel_communication_data_type": "the context all-to-alls and ring move the "
                                            "activations in their own dtype",
}
_ACTIVATIONS = {"partition_activations": "zero.partition_activations",
                "cpu_checkpointing": "zero.offload_activations"}
_ACTIVATIONS_IGNORED = {
    "contiguous_memory_optimization": "XLA lays out the saved layer inputs",
    "number_checkpoints": "each layer's input is saved (stage 3's schedule; model.remat)",
    "synchronize_checkpoint_boundary": "the compiled step orders its own transfers",
    "profile": "`zjax plan` reports the compiled step's memory",
}
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "float32": "float32",
           "float16": "float16", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class DeepSpeedImport:
    """What a DeepSpeed config became.

    Attributes:
      overrides: zjax ``key=value`` overrides, in the order they were read.
      ignored: ``(DeepSpeed key, reason)`` of each key with no zjax meaning.
    """

    overrides: tuple[str, ...]
    ignored: tuple[tuple[str, str], ...]


def _offload(r: Reader, section: str, d: dict) -> None:
    zkey = f"zero.{section}"
    for key, value in d.items():
        where = f"zero_optimization.{section}.{key}"
        if key == "device":
            device = {"cpu": "host", "none": "none"}.get(str(value), str(value))
            r.set(f"{zkey}.device", device)
        elif key == "pin_memory":
            r.set(f"{zkey}.pin_memory", bool(value))
        elif key == "buffer_size" and section == "offload_param":
            r.set(f"{zkey}.buffer_size", number(where, value, int))
        elif key == "nvme_path":
            r.set(f"{zkey}.nvme_path", None if value is None else str(value))
        elif key == "buffer_count":
            r.set(f"{zkey}.buffer_count", number(where, value, int))
        elif key in _OFFLOAD_IGNORED:
            r.ignore(where, _OFFLOAD_IGNORED[key])
        else:
            raise r.unknown(where, ["device", "pin_memory", "nvme_path", "buffer_count",
                                    *(["buffer_size"] if section == "offload_param" else []),
                                    *_OFFLOAD_IGNORED])


def _zero(r: Reader, d: dict, *, gather_bytes: int, n_data: int) -> None:
    direct = {"stage": ("zero.stage", int), "sub_group_size": ("zero.sub_group_size", int),
              "stage3_param_persistence_threshold": ("zero.param_persistence_threshold", int),
              "stage3_max_live_parameters": ("zero.max_live_parameters", int)}
    for key, value in d.items():
        where = f"zero_optimization.{key}"
        if auto(r, where, value):
            continue
        if key in direct:
            zkey, kind = direct[key]
            r.set(zkey, number(where, value, kind))
        elif key == "stage3_prefetch_bucket_size":  # DeepSpeed counts elements, zjax bytes
            r.set("zero.prefetch_bucket_size", number(where, value, int) * gather_bytes)
            r.set("zero.prefetch_layers", None)  # the bucket decides the depth
        elif key in ("offload_optimizer", "offload_param"):
            _offload(r, key, object_of(where, value))
        elif key in _ZERO_IGNORED:
            r.ignore(where, _ZERO_IGNORED[key])
        elif key in ("zero_hpz_partition_size", "mics_shard_size") \
                and number(where, value, int) in (1, -1):
            r.ignore(where, "the default (no secondary partition)")
        elif key == "mics_shard_size":  # MiCS: shard within groups of this size, replicate
            size = number(where, value, int)
            if size < 1 or n_data % size:
                raise ConfigError(f"deepspeed {where}: {value!r} does not divide the {n_data} "
                                  "data ranks (devices / mesh.model)")
            r.set("mesh.data", size)
            r.set("mesh.replica", n_data // size)
        elif key == "mics_hierarchical_params_gather":
            r.ignore(where, "zjax's gathers never leave a replica group (mesh.replica), so "
                     "there is nothing to make hierarchical")
        elif key in ("zero_quantized_weights", "zero_quantized_gradients") and not value:
            r.ignore(where, "off")
        elif key in ("zero_quantized_weights", "zero_quantized_gradients"):  # qwZ, qgZ
            r.set(f"zero.{key.removeprefix('zero_')}", True)
        elif key == "zero_hpz_partition_size":  # hpZ: the devices of a node
            size = number(where, value, int)
            if size < 1 or n_data % size:
                raise ConfigError(f"deepspeed {where}: {value!r} does not divide the {n_data} "
                                  "data ranks (devices / mesh.model)")
            r.set("zero.hpz_partition_size", size)
        else:
            raise r.unknown(where, [*direct, "stage3_prefetch_bucket_size", "offload_optimizer",
                                    "offload_param", *_ZERO_IGNORED])


def _optimizer(r: Reader, d: dict) -> None:
    kind = str(d.get("type", "")).lower()
    params = object_of("optimizer.params", d.get("params", {}) or {})
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"deepspeed optimizer.type: {d.get('type')!r} is not mapped; zjax "
                          "builds Adam, AdamW or SGD (optimizer.name); use Adam or AdamW")
    decoupled = kind == "adamw" or params.get("adam_w_mode", True)  # DeepSpeed's default
    decay = params.get("weight_decay", 0.0)
    if not decoupled and decay not in (0, "auto"):
        raise ConfigError("deepspeed optimizer.params.adam_w_mode: false with weight_decay "
                          f"{decay}: L2-regularised Adam is not in zjax; use AdamW")
    r.set("optimizer.name", "adamw" if decoupled else "adam")
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if auto(r, where, value):
            continue
        if key == "lr":
            r.set("optimizer.lr", number(where, value))
        elif key == "betas":
            if not isinstance(value, list | tuple) or len(value) != 2:
                raise ConfigError(f"deepspeed {where}: expected [beta1, beta2], got {value!r}")
            r.set("optimizer.b1", number(where, value[0]))
            r.set("optimizer.b2", number(where, value[1]))
        elif key == "eps":
            r.set("optimizer.eps", number(where, value))
        elif key == "weight_decay":
            r.set("optimizer.weight_decay", number(where, value))
        elif key in ("adam_w_mode", "torch_adam", "fused", "bias_correction", "amsgrad"):
            if key == "amsgrad" and value:
                raise ConfigError(f"deepspeed {where}: true: AMSGrad is not in zjax")
            r.ignore(where, "optax's Adam/AdamW with bias correction")
        else:
            raise r.unknown(where, ["lr", "betas", "eps", "weight_decay", "adam_w_mode"])


def _scheduler(r: Reader, d: dict) -> None:
    kind = d.get("type")
    params = object_of("scheduler.params", d.get("params", {}) or {})
    known = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
    if kind not in known:
        raise ConfigError(f"deepspeed scheduler.type: {kind!r} is not mapped"
                          f"{did_you_mean(str(kind), known)}; zjax warms up linearly, then "
                          f"keeps the rate or decays it by a cosine: use one of {known}")
    r.set("optimizer.schedule", "constant" if kind == "WarmupLR" else "cosine")
    if kind == "WarmupDecayLR":
        r.ignore("scheduler.type", "WarmupDecayLR decays linearly to 0; zjax's cosine decays to "
                 "lr/10 at the last step")
    for key, value in params.items():
        where = f"scheduler.params.{key}"
        if auto(r, where, value):
            continue
        if key == "warmup_num_steps":
            r.set("optimizer.warmup_steps", number(where, value, int))
        elif key in ("warmup_max_lr",):
            r.set("optimizer.lr", number(where, value))
        elif key == "total_num_steps":
            r.set("train.steps", number(where, value, int))
        elif key in ("warmup_min_lr", "warmup_min_ratio") and number(where, value) == 0:
            r.ignore(where, "0: zjax warms up from 0")
        elif key == "cos_min_ratio" and number(where, value) == 0.1:
            r.ignore(where, "0.1: zjax's cosine ends at lr/10")
        elif key in ("warmup_type", "last_batch_iteration"):
            r.ignore(where, "zjax warms up linearly from step 0")
        elif key in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio"):
            raise ConfigError(f"deepspeed {where}: {value!r}: zjax warms up from 0 and its "
                              "cosine ends at lr/10; remove the key or use those values")
        else:
            raise r.unknown(where, ["warmup_num_steps", "warmup_max_lr", "total_num_steps",
                                    "warmup_min_lr", "cos_min_ratio", "warmup_type"])


def _batch(r: Reader, ds: dict, n_data: int) -> None:
    """DeepSpeed's train_batch_size = micro batch per GPU x accumulation steps x data ranks;
    zjax's data.batch_size is the global batch of one optimizer step."""
    vals = {k: ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                   "gradient_accumulation_steps")}
    for k, v in vals.items():
        if v == "auto":
            r.ignore(k, '"auto": zjax\'s default is kept')
            vals[k] = None
        elif v is not None:
            vals[k] = number(k, v, int)
    total, micro, gas = vals.values()
    if total is None and micro is not None:
        total = micro * (gas or 1) * n_data
    if gas is None and total is not None and micro is not None:
        if total % (micro * n_data):
            raise ConfigError(f"deepspeed train_batch_size: {total} is not a multiple of "
                              f"train_micro_batch_size_per_gpu {micro} x {n_data} data ranks")
        gas = total // (micro * n_data)
    if None not in (total, micro, gas) and total != micro * gas * n_data:
        raise ConfigError(f"deepspeed train_batch_size: {total} != "
                          f"train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {gas} x {n_data} data ranks")
    if total is not None:
        r.set("data.batch_size", total)
    if gas is not None:
        r.set("train.grad_accum", gas)


def _activations(r: Reader, d: dict) -> None:
    """``activation_checkpointing``: ZeRO-R's partitioned and host-memory layer inputs."""
    for key, value in d.items():
        where = f"activation_checkpointing.{key}"
        if key in _ACTIVATIONS:
            if not isinstance(value, bool):
                raise ConfigError(f"deepspeed {where}: expected true or false, got {value!r}")
            r.set(_ACTIVATIONS[key], value)
        elif key in _ACTIVATIONS_IGNORED:
            r.ignore(where, _ACTIVATIONS_IGNORED[key])
        else:
            raise r.unknown(where, [*_ACTIVATIONS, *_ACTIVATIONS_IGNORED])


def _sequence_parallel(r: Reader, ds: dict, n_data: int) -> int:
    """DeepSpeed-Ulysses' ``sequence_parallel_size`` -> ``mesh.context``; the data ranks."""
    size = number("sequence_parallel_size", ds.get("sequence_parallel_size", 1), int)
    if size < 1 or n_data % size:
        raise ConfigError(f"deepspeed sequence_parallel_size: {size!r} does not divide the "
                          f"{n_data} devices (over mesh.model)")
    if "sequence_parallel_size" in ds:
        r.set("mesh.context", size)
    return n_data // size


def from_deepspeed(ds: dict, *, n_data: int) -> DeepSpeedImport:
    """Map a DeepSpeed config (the JSON object) to zjax overrides.

    Args:
      ds: the parsed ``ds_config.json``.
      n_data: devices / ``mesh.model``: DeepSpeed's batch sizes are per GPU, zjax's
        ``data.batch_size`` is global (the data ranks are these over ``sequence_parallel_size``).

    Raises:
      ConfigError: naming the DeepSpeed key that is unknown, not supported or impossible.
    """
    r = Reader()
    enabled = {k: object_of(k, ds.get(k) or {}).get("enabled", False) for k in ("bf16", "fp16")}
    precision = {k: v is True for k, v in enabled.items()}
    if precision["bf16"] and precision["fp16"]:
        raise ConfigError("deepspeed bf16.enabled and fp16.enabled: both true; choose one")
    gather = "bfloat16" if precision["bf16"] else "float16" if precision["fp16"] else "float32"
    if "auto" in enabled.values():  # HF Trainer decides: zjax's gather dtype is kept
        r.ignore("bf16/fp16.enabled", '"auto": zjax\'s zero.gather_dtype is kept')
    else:
        r.set("zero.gather_dtype", gather)
    if precision["fp16"]:
        r.ignore("fp16", "float16 gathers with a float32 master; zjax has no loss scaling "
                 "(bf16 is the safer choice)")
    n_data = _sequence_parallel(r, ds, n_data)
    for key, value in ds.items():
        if key in ("bf16", "fp16", "train_batch_size", "train_micro_batch_size_per_gpu",
                   "gradient_accumulation_steps", "sequence_parallel_size"):
            continue
        if key == "zero_optimization":
            _zero(r, object_of(key, value), gather_bytes=2 if gather != "float32" else 4,
                  n_data=n_data)
        elif key == "optimizer":
            _optimizer(r, object_of(key, value))
        elif key == "scheduler":
            _scheduler(r, object_of(key, value))
        elif key == "activation_checkpointing":
            _activations(r, object_of(key, value))
        elif key == "moe":  # DeepSpeed reads `"moe": true` as {"enabled": true}
            moe(r, {"enabled": value} if isinstance(value, bool) else object_of(key, value),
                n_data=n_data)
        elif key == "gradient_clipping":
            if not auto(r, key, value):
                clip = number(key, value)
                r.set("optimizer.clip_norm", clip if clip > 0 else None)
        elif key == "steps_per_print":
            if not auto(r, key, value):
                r.set("train.log_every", number(key, value, int))
        elif key == "communication_data_type":
            if value not in _DTYPES:
                raise ConfigError(f"deepspeed {key}: {value!r}; expected one of "
                                  f"{', '.join(_DTYPES)}")
            r.set("zero.reduce_dtype", _DTYPES[value])
        elif key in ("amp", "elasticity", "sparse_attention") \
                and object_of(key, value or {}).get("enabled"):
            raise ConfigError(f"deepspeed {key}: enabled, which zjax does not have")
        elif key in _TOP_IGNORED or key in ("amp", "elasticity", "sparse_attention"):
            r.ignore(key, _TOP_IGNORED.get(key) or "not enabled")
        else:
            raise r.unknown(key, ["zero_optimization", "optimizer", "scheduler", "bf16", "fp16",
                                  "train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps", "gradient_clipping",
                                  "sequence_parallel_size", "moe",
                                  "steps_per_print", "activation_checkpointing",
                                  *_TOP_IGNORED])
    _batch(r, ds, n_data)
    overrides = tuple(f"{k}={json.dumps(v)}" for k, v in r.out.items())
    return DeepSpeedImport(overrides, tuple(r.ignored))
