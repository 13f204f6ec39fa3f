"""From a whole :class:`~zjax.config.Config` to the parts that each take their own section.

The one place that reads a config's sections to build a step: the trainer, the planner, the
autotuner and the tests all go through :func:`build_step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from zjax.errors import ArgumentError, ConfigError
from zjax.runtime.mesh import make_mesh
from zjax.runtime.targets import Target
from zjax.step import ZeroStep, make_step
from zjax.step.optim import make_optimizer, with_router_bias
from zjax.task.loop import Loop, resolve_loop

if TYPE_CHECKING:
    from zjax.config import Config

__all__ = ["CONFIG_KEYS", "abstract_batch", "build_step", "config_keys", "flops_shape"]

# the engine's argument -> the config key it is built from (errors name the key)
CONFIG_KEYS = {
    "batch": "data.batch_size",
    "micro_batches": "train.grad_accum",
    "mesh": "mesh.model",  # the engine's mesh errors are all about its model axis
    "tokens": "data.seq_len",
}


@contextlib.contextmanager
def config_keys() -> Iterator[None]:
    """Errors about the engine's arguments, raised inside, name the config keys instead."""
    try:
        yield
    except ArgumentError as e:
        raise e.renamed(CONFIG_KEYS) from None


def build_step(config: Config, devices: Sequence[jax.Device] | Target | None = None, *,
               loop: Loop | None = None) -> ZeroStep:
    """The ZeRO step ``config`` describes, on ``devices``.

    Args:
      config: a resolved config; its ``mesh``, ``optimizer``, ``zero``, ``model`` and
        ``train`` sections are read.
      devices: the devices of the mesh, or a compile-only :class:`~zjax.runtime.targets.Target`
        (its devices). Default: all of this process's.
      loop: the task (model and data); default: the one ``config.loop`` names.

    Returns:
      A :class:`~zjax.step.ZeroStep`, not compiled yet.
    """
    loop = loop if loop is not None else resolve_loop(config.loop)
    if isinstance(devices, Target):
        devices = devices.devices
    _check_experts(config)
    mesh = make_mesh(config.mesh, devices=None if devices is None else list(devices))
    _check_fp8(config, mesh.devices.flat[0])
    # the NVMe optimizer updates sub-groups apart: the step clips, by the norm of the whole
    nvme = config.zero.offload_optimizer.nvme
    tx = make_optimizer(config.optimizer, total_steps=config.train.steps, clip_in_step=nvme)
    if getattr(config.model, "router_score", None) == "sigmoid":  # DeepSeek-V3's bias
        tx = with_router_bias(tx, config.model.router_bias_update_speed)
    with config_keys():
        return make_step(_trainable(loop, config), tx, zero=config.zero, mesh=mesh,
                         micro_batches=config.train.grad_accum,
                         skip_nonfinite=config.train.on_nonfinite == "skip",
                         clip_norm=config.optimizer.clip_norm if nvme else None)


def _check_fp8(config: Config, device: jax.Device) -> None:
    """``model.fp8`` where the matrix units have no FP8: refused, by key."""
    fp8 = getattr(config.model, "fp8", "none")
    if config.zero.fp8_gather and fp8 == "none":
        raise ConfigError("zero.fp8_gather: true gathers the weights of FP8 matmuls, but "
                          "model.fp8 is none; set model.fp8: tensorwise")
    if fp8 != "none" and device.platform == "tpu":
        raise ConfigError(f"model.fp8: {fp8} on {device.device_kind}: TPUs have no FP8 matrix "
                          "unit (MaxText trains with int8 there); use model.fp8: none")


def _trainable(loop: Loop, config: Config):
    """The loop's model; with ``lora.rank`` > 0, its adapters over the frozen base (a loop
    that takes a ``lora`` section builds them); with ``preference.method``, trained on that
    preference loss (a loop that takes a ``preference`` section)."""
    if config.lora.init_adapter is not None and not (config.lora.enabled
                                                     and config.train.init_from):
        raise ConfigError(f"lora.init_adapter: {config.lora.init_adapter} continues an "
                          "adapter over its base: set lora.rank (the adapter's) and "
                          "train.init_from (the base it was trained on)")
    kwargs = {}
    takes = inspect.signature(loop.trainable).parameters
    if config.lora.enabled:
        if "lora" not in takes:
            raise ConfigError(f"lora.rank: {config.lora.rank}, but loop {config.loop!r} builds "
                              "no adapters (its trainable() takes no lora section); set "
                              "lora.rank=0")
        kwargs["lora"] = config.lora
    if config.preference.enabled:
        if "preference" not in takes:
            raise ConfigError(f"preference.method: {config.preference.method}, but loop "
                              f"{config.loop!r} has no preference loss (its trainable() takes "
                              "no preference section); use loop lm or llama")
        kwargs |= {"preference": config.preference,
                   "reference_dtype": config.zero.gather_dtype}
    if config.rl.enabled:
        kwargs |= _rl_kwargs(loop, config, takes)
    trainable = loop.trainable(config.model, **kwargs)
    if trainable.dropout_seed is not None:  # the adapters' dropout masks follow train.seed
        trainable = dataclasses.replace(trainable, dropout_seed=config.train.seed)
    return trainable


def _rl_kwargs(loop: Loop, config: Config, takes) -> dict:
    """The ``rl`` section for a loop that trains with it (refused otherwise)."""
    if "rl" not in takes:
        raise ConfigError(f"rl.method: {config.rl.method}, but loop {config.loop!r} has no "
                          "GRPO loss (its trainable() takes no rl section); use loop lm or "
                          "llama")
    if config.mesh.context > 1:
        raise ConfigError(f"mesh.context: {config.mesh.context}, but GRPO's completions are "
                          "trained without a context axis; set mesh.context=1")
    return {"rl": config.rl, "reference_dtype": config.zero.gather_dtype}


def _check_experts(config: Config) -> None:
    """``mesh.expert`` splits a reference model's experts: it must divide them."""
    n, experts = config.mesh.expert, getattr(config.model, "n_experts", None)
    if n == 1 or experts is None:  # a user's model: the plan checks its named dimensions
        return
    if not experts:
        raise ConfigError(f"mesh.expert: {n} splits a mixture's experts, but the model is "
                          "dense (model.n_experts: 0)")
    if experts % n:
        raise ConfigError(f"mesh.expert: {n} does not divide model.n_experts {experts}")


def abstract_batch(config: Config, *, loop: Loop | None = None) -> jax.ShapeDtypeStruct:
    """The global batch of ``config``'s data as a ``ShapeDtypeStruct`` (nothing loaded when
    the loop knows its shape; a user's loop gives its first batch)."""
    loop = loop if loop is not None else resolve_loop(config.loop)
    if config.rl.enabled:  # rollout rows: prompt and completion, advantages, log-probs
        from zjax.rl import scored_keys

        rows, width = config.data.batch_size, config.data.seq_len
        batch = {"tokens": jax.ShapeDtypeStruct((rows, width + 1), np.int32),
                 "loss_mask": jax.ShapeDtypeStruct((rows, width + 1), np.int32),
                 "advantages": jax.ShapeDtypeStruct((rows,), np.float32)}
        return batch | {k: jax.ShapeDtypeStruct((rows, width), np.float32)
                        for k in scored_keys(config.rl)}
    if config.preference.enabled:  # pairs, whatever the data section's format
        from zjax.data import abstract_preference_batch

        return abstract_preference_batch(
            config.data, ref_logps=config.preference.source == "precompute")
    if hasattr(loop, "abstract_batch"):
        return loop.abstract_batch(config.data)
    first = next(iter(loop.data(config.data, split="train", seed=0)))
    return jax.ShapeDtypeStruct((config.data.batch_size, *first.shape[1:]), first.dtype)


def flops_shape(config: Config) -> dict:
    """``tokens_per_step`` and ``model_shape`` of :func:`zjax.planning.report` (model FLOPs):
    the global batch's tokens, and the transformer's depth, width and sequence length when
    the model section names them (a user's model may not: then 6N only), with a Llama's
    attention width, windowed layers and, for a mixture, the parameters of the experts a
    token is not routed to (``inactive_params``: model FLOPs count active parameters) and
    its ``n_experts``; a preference loss with a reference model, its forward
    (``reference_forwards``)."""
    model = config.model
    shape = {"n_layers": getattr(model, "n_layers", None),
             "d_model": getattr(model, "d_model", None), "seq_len": config.data.seq_len}
    if None in shape.values():
        shape = {}
    elif hasattr(model, "head_width"):  # Llama's: heads of their own width, windowed layers
        # latent attention: scores over the query/key width, the sum over the value width
        width = (model.head_width + model.v_head_dim) / 2 if model.kv_lora_rank \
            else model.head_width
        shape |= {"attn_width": int(model.n_heads * width),
                  "window": model.sliding_window,
                  "windowed_layers": sum(map(model.windowed, range(model.n_layers)))}
        if getattr(model, "n_experts", 0):  # the experts a token is not routed to
            moe_layers = model.n_layers - model.first_k_dense  # DeepSeek's dense ones apart
            shape["n_experts"], shape["moe_layers"] = model.n_experts, moe_layers
            shape["inactive_params"] = (moe_layers * (model.n_experts - model.experts_per_token)
                                        * 3 * model.d_model * model.expert_ff)
    if config.preference.enabled and config.preference.source == "model" and shape:
        shape["reference_forwards"] = 1  # the reference's forward over every sequence
    return {"tokens_per_step": config.data.batch_size * config.data.seq_len,
            "model_shape": shape}
