"""Where a run's state starts: a random init or the weights ``train.init_from`` names (an
adapters' base, with ``lora.init_adapter``'s PEFT adapters), the frozen leaves read again on
resume, and the check that a resumed run's base is the one its checkpoint trained over."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

from zjax.config import Config
from zjax.errors import CheckpointError, ConfigError
from zjax.models import model_class
from zjax.partition import trained_part
from zjax.step import TrainState, ZeroStep

__all__ = ["check_base", "initial_frozen", "initial_state", "peft_adapters"]


# the lora keys that give the adapters their meaning: a resume changing one would go on
# training other functions of the same numbers (lora.dropout, a training option, may change)
_ADAPTER_KEYS = ("rank", "alpha", "rslora", "targets", "base_dtype")


def check_base(got: dict[str, str], meta: dict | None, config: Config) -> None:
    """The base read again on resume (its digests ``got``) must be the one the checkpoint's
    adapters trained over (the digests recorded in the checkpoint's meta), and the adapters
    must mean what they meant (:data:`_ADAPTER_KEYS` as the checkpoint's run had them)."""
    saved = ((meta or {}).get("config") or {}).get("lora") or {}
    for key in _ADAPTER_KEYS:
        if key in saved and config.lora.enabled and saved[key] != getattr(config.lora, key):
            raise ConfigError(
                f"lora.{key}: {getattr(config.lora, key)!r}, but the checkpoint's adapters were "
                f"trained with {saved[key]!r} (they would compute another update); set "
                f"lora.{key}: {saved[key]!r} to resume, or train in a new run directory")
    want = (meta or {}).get("base_digests")
    if not want:
        return
    changed = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    what = ("adapters were trained over" if config.lora.enabled
            else "preference reference was copied from")
    if changed:
        raise CheckpointError(
            f"train.init_from: {config.train.init_from} is not the base the checkpoint's "
            f"{what} ({changed[0]} differs, of {len(changed)} frozen leaves); point "
            "train.init_from at that base, or train in a new run directory")


def initial_frozen(zstep: ZeroStep, config: Config, info) -> Any:
    """The frozen leaves at the start, read again for a resume: a preference reference from
    the starting weights alone (no optimizer state beside the restored one), an adapters'
    base as the start reads it."""
    if not zstep.derived_frozen:
        return initial_state(zstep, config, info).frozen
    if config.train.init_from is None:
        return zstep.frozen_init(jax.random.key(config.train.seed))
    from zjax.hf import initial_params

    return zstep.frozen_of(initial_params(config.train.init_from, zstep.params_target,
                                          config.model))


def initial_state(zstep: ZeroStep, config: Config, info) -> TrainState:
    """A random init, or the weights ``train.init_from`` names read into their shards."""
    if config.train.init_from is None:
        if config.lora.enabled:
            logging.getLogger("zjax").warning(
                "lora.rank: %d with no train.init_from: the adapters train over a random base "
                "(train.seed's), which no file holds and export --format hf cannot merge "
                "into; set train.init_from to the model to adapt", config.lora.rank)
        return zstep.init(jax.random.key(config.train.seed))
    from zjax.hf import initial_params

    info("initial params from %s", config.train.init_from)
    if zstep.from_base is not None:  # adapters: the base read, the adapters initialised
        base = initial_params(config.train.init_from, zstep.base_target, config.model)
        if config.lora.init_adapter is not None:
            info("initial adapters from %s", config.lora.init_adapter)
            # through from_base, which stores the base as the run does (quantized for QLoRA)
            return zstep.from_base(base, peft_adapters(zstep, config))
        return zstep.from_base(base, jax.random.key(config.train.seed))
    return zstep.from_params(initial_params(config.train.init_from, zstep.params_target,
                                            config.model))


def peft_adapters(zstep: ZeroStep, config: Config) -> Any:
    """``lora.init_adapter``'s adapters as the step's trained leaves (float32 on the host),
    refused unless its rank, scaling and targets are the ``lora`` section's."""
    from zjax.hf import layout_for_model, read_peft

    lora, cls = config.lora, model_class(config.model)
    if cls is None:
        raise ConfigError(f"lora.init_adapter: PEFT adapters load into the built-in models "
                          f"(loop lm, llama), not loop {config.loop!r}")
    found, adapters = read_peft(Path(lora.init_adapter), layout_for_model(
        config.loop, config.model), config.model, key="lora.init_adapter")
    trained = trained_part(zstep.plan)
    keys = [tuple(leaf.path.split("/")) for leaf in trained.leaves]
    for key in ("rank", "alpha", "rslora", "targets"):
        want, got = getattr(lora, key), getattr(found, key)
        # targets: the same adapted weights of this model ('all-linear' or their names)
        if want == got or (key == "targets" and set(keys) == set(adapters)):
            continue
        raise ConfigError(f"lora.{key}: {want!r}, but the adapter in "
                          f"lora.init_adapter ({lora.init_adapter}) has {got!r}")
    return trained.tree(adapters[k] for k in keys)
