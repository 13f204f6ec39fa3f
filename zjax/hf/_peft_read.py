"""Reading a PEFT LoRA adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
as zjax's adapter leaves, exactly as PEFT would apply it to the same model, or not at all.

PEFT adapts the modules ``target_modules`` matches (a list: a module's name or its last
components; a string: ``re.fullmatch`` on the whole name, or ``all-linear``), less
``exclude_modules``, within ``layers_to_transform``. zjax's adapters cover a module name in
every layer: the layers PEFT leaves out get zeros in both factors, which is the base's
function and stays so in training (both factors' gradients are zero). Everything else an
adapter can carry that zjax does not compute (DoRA's magnitudes, per-module ranks and alphas,
biases, whole modules to save, ...) refuses the adapter naming the field; so does any tensor
that is not where the config says, of the wrong shape, or not finite.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zjax.errors import CheckpointError
from zjax.hf._layout import Layout
from zjax.hf._peft import PeftName, peft_names
from zjax.hf._safetensors import DTYPES, read_header
from zjax.lora import ADAPTER_SUFFIXES, ALL_LINEAR, LoraConfig

__all__ = ["read_peft"]

log = logging.getLogger("zjax")
Keys = tuple[str, ...]
# Mixtral's experts' modules (w1, w3, w2) as lora.targets names them
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# PEFT's fields that change what the adapter computes, refused unless at their default
_REFUSED = {
    "use_dora": "DoRA's magnitude vectors",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "whole modules trained beside the adapters",
    "layer_replication": "replicated layers",
    "trainable_token_indices": "trained token embeddings",
    "target_parameters": "adapters on parameters, not modules",
    "use_qalora": "QA-LoRA's pooled inputs",
    "alora_invocation_tokens": "activated LoRA",
}
# fields read below, and those that do not change the function (PEFT's bookkeeping, training
# and initialisation options)
_READ = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
         "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "bias"}
_INERT = {"task_type", "base_model_name_or_path", "revision", "inference_mode", "lora_dropout",
          "fan_in_fan_out", "init_lora_weights", "auto_mapping", "megatron_config",
          "megatron_core", "loftq_config", "eva_config", "corda_config", "runtime_config",
          "qalora_group_size", "peft_version", "ensure_weight_tying"}


def read_peft(directory: str | Path, layout: Layout, model: Any, *,
              key: str = "--adapter") -> tuple[LoraConfig, dict[Keys, np.ndarray]]:
    """``(lora section, adapters)`` of the PEFT LoRA directory for ``model``: the adapters as
    zjax leaves by keys (``[L, in, r]`` and ``[L, r, out]``, float32).

    Args:
      directory: PEFT's ``save_pretrained`` output.
      layout: the model's Hugging Face layout (PEFT's module names).
      model: the ``model`` section of the model the adapter is for.
      key: what named the directory, for the messages (``--adapter``, ``lora.init_adapter``).

    Raises:
      CheckpointError: the directory is not a LoRA adapter zjax computes exactly as PEFT for
        this model (one line naming the file and the field or tensor).
    """
    directory = Path(directory)
    meta = _config(directory, key)
    rank, alpha, rslora = _scalars(meta, f"{key}: {directory / 'adapter_config.json'}")
    tensors = _tensors(directory / "adapter_model.safetensors", key)
    where = f"{key}: {directory / 'adapter_model.safetensors'}"
    _refuse_extras(meta, tensors, where)
    names = _candidates(layout, model)
    targeted = _matcher(meta, f"{key}: {directory / 'adapter_config.json'}")
    targets = sorted({_zjax_name(n.module) for keys, n in names.items()
                      for i, e in _indices(keys, n, model) if targeted(_module(n, i, e))})
    if not targets:
        raise CheckpointError(f"{key}: {directory / 'adapter_config.json'}: target_modules "
                              f"{meta.get('target_modules')!r} matches no linear module of this "
                              "model that zjax adapts (another architecture?)")
    lora = LoraConfig(rank=rank, alpha=alpha, rslora=rslora, targets=targets)
    out = {}
    for keys, shape in _adapter_shapes(model, lora).items():
        if keys not in names:  # a stack no Hugging Face model has (DeepSeek's MTP): unadapted
            out[keys] = np.zeros(shape, np.float32)
            continue
        out[keys] = _leaf(keys, shape, names[keys], tensors, targeted, rank, where)
    if tensors:
        _refuse_left(sorted(tensors), names, model, where)
    return lora, out


def _refuse_left(left: list[str], names: dict[Keys, PeftName], model: Any, where: str) -> None:
    """Refuse the tensors no adapter leaf took, saying why: a module the config leaves out,
    or one this model does not have."""
    modules = {n.at(i, e): _module(n, i, e) for keys, n in names.items()
               for i, e in _indices(keys, n, model)}
    for tensor in left:
        if tensor in modules:
            raise CheckpointError(f"{where}: tensor {tensor!r} is for module "
                                  f"{modules[tensor]}, which the adapter's target_modules "
                                  "leaves out")
    raise CheckpointError(f"{where}: tensor {left[0]!r} (of {len(left)} left) is for no module "
                          "of this model that zjax adapts (a layer or module it does not "
                          "have: another model?)")


def _config(directory: Path, key: str) -> dict:
    path = directory / "adapter_config.json"
    if not directory.is_dir():
        raise CheckpointError(f"{key}: {directory} is not a directory (expected a PEFT adapter "
                              "directory: adapter_config.json, adapter_model.safetensors)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{key}: {path}: not a PEFT adapter config (readable JSON): "
                              f"{e}") from None
    if not isinstance(meta, dict) or meta.get("peft_type") != "LORA":
        got = meta.get("peft_type") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{key}: {path}: peft_type {got!r}, expected 'LORA'")
    return meta


def _scalars(meta: dict, where: str) -> tuple[int, float, bool]:
    """``r``, ``lora_alpha`` (PEFT's default 8 where absent) and ``use_rslora``."""
    r = meta.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CheckpointError(f"{where}: r is {r!r}; expected the adapters' rank, a whole "
                              "number >= 1")
    alpha = meta.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not (
            math.isfinite(alpha) and alpha > 0):
        raise CheckpointError(f"{where}: lora_alpha is {alpha!r}; expected a number > 0 (the "
                              "update's scale is lora_alpha / r)")
    rslora = meta.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise CheckpointError(f"{where}: use_rslora is {rslora!r}; expected true or false")
    for field, default in (("rank_pattern", r), ("alpha_pattern", alpha)):
        pattern = meta.get(field) or {}
        if not isinstance(pattern, dict) or any(v != default for v in pattern.values()):
            raise CheckpointError(
                f"{where}: {field} {pattern!r} gives modules their own "
                f"{'rank' if field == 'rank_pattern' else 'alpha'}, which zjax does not "
                f"compute (one r and lora_alpha for every module); not loaded")
    for field, what in _REFUSED.items():
        if meta.get(field):
            raise CheckpointError(f"{where}: {field} {meta[field]!r} ({what}) is not "
                                  "computed by zjax; an adapter that sets it is not loaded")
    unknown = sorted(k for k, v in meta.items()
                     if k not in _READ | _INERT | set(_REFUSED) and v not in (None, False, [], {}))
    if unknown:
        log.warning("%s: zjax does not read the fields %s (set here); the adapter is loaded "
                    "without them", where, ", ".join(unknown))
    return r, float(alpha), rslora


def _tensors(path: Path, key: str) -> dict[str, np.ndarray]:
    """Every tensor of the file, float32, refused where not finite."""
    if not path.is_file():
        other = [p.name for p in path.parent.glob("adapter_model.*")]
        raise CheckpointError(f"{key}: {path} is missing" + (
            f" ({', '.join(other)} found: zjax reads adapters in safetensors only; save "
            "with safe_serialization=True)" if other else ""))
    try:  # every entry checked against the file's size
        header, _, start = read_header(path)
    except CheckpointError as e:
        raise CheckpointError(f"{key}: {e}") from None
    out = {}
    for name, t in header.items():
        if t["dtype"] not in ("F64", "F32", "F16", "BF16"):
            raise CheckpointError(f"{key}: {path}: tensor {name!r} is {t['dtype']}; expected "
                                  "floating-point adapter weights")
        values = np.fromfile(path, dtype=DTYPES[t["dtype"]], count=math.prod(t["shape"]),
                             offset=start + t["data_offsets"][0]).reshape(t["shape"])
        values = values.astype(np.float32)
        bad = int(values.size - np.isfinite(values).sum())
        if bad:
            raise CheckpointError(f"{key}: {path}: tensor {name!r} holds {bad} NaN or infinite "
                                  f"value{'s' if bad > 1 else ''} (a damaged or diverged "
                                  "adapter)")
        out[name] = values
    return out


def _refuse_extras(meta: dict, tensors: dict, where: str) -> None:
    """Tensors that are not LoRA factors: biases (PEFT's ``bias``), DoRA's magnitudes."""
    for name in sorted(tensors):
        if name.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        if name.endswith(".bias"):
            raise CheckpointError(
                f"{where}: tensor {name!r}: the adapter trains biases (bias: "
                f"{meta.get('bias')!r}), which zjax does not load; not loaded")
        if "lora_magnitude_vector" in name:
            raise CheckpointError(f"{where}: tensor {name!r} is DoRA's (use_dora), which zjax "
                                  "does not compute; not loaded")
        raise CheckpointError(f"{where}: tensor {name!r} is not a LoRA factor (lora_A.weight, "
                              "lora_B.weight); not loaded")


def _matcher(meta: dict, where: str) -> Callable[[str], bool]:
    """PEFT's ``check_target_module_exists`` for LoRA: whether it adapts module ``name``."""
    targets, exclude = meta.get("target_modules"), meta.get("exclude_modules")
    layers, pattern = meta.get("layers_to_transform"), meta.get("layers_pattern")
    for field, value in (("target_modules", targets), ("exclude_modules", exclude)):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise CheckpointError(f"{where}: {field} {value!r} is not a regular expression "
                                      f"({e})") from None
        elif value is not None and not (isinstance(value, list)
                                        and all(isinstance(t, str) for t in value)):
            raise CheckpointError(f"{where}: {field} is {value!r}; expected a list of module "
                                  "names or a regular expression")
    if targets is None:
        raise CheckpointError(f"{where}: target_modules is missing; expected the adapted "
                              "modules' names (PEFT writes them)")
    patterns = [pattern] if isinstance(pattern, str) else (pattern or [])
    wanted = {layers} if isinstance(layers, int) else set(layers or [])

    def matches(name: str) -> bool:
        if _listed(exclude, name):
            return False
        if targets == ALL_LINEAR:  # every linear layer but the head, which zjax never adapts
            return True
        if isinstance(targets, str):
            return re.fullmatch(targets, name) is not None
        if not _listed(targets, name):
            return False
        if not wanted:
            return True
        found = ([re.match(r".*\.[^.]*\.(\d+)\.", name)] if not patterns else
                 [re.match(rf".*\.{p}\.(\d+)\.", name) for p in patterns])
        index = next((m for m in found if m is not None), None)
        return index is not None and int(index.group(1)) in wanted

    return matches


def _listed(names, name: str) -> bool:
    """PEFT's match of ``name`` by ``names``: a regular expression matching it whole, or a
    list holding it or one of its endings."""
    if not names:
        return False
    if isinstance(names, str):
        return re.fullmatch(names, name) is not None
    return name in names or any(name.endswith(f".{n}") for n in names)


def _candidates(layout: Layout, model: Any) -> dict[Keys, PeftName]:
    """The adapter leaves zjax can give this model, by keys: those of its linear layers."""
    from zjax.models import adapted_weights, model_class

    every = adapted_weights(model_class(model).LORA_MODULES,
                            LoraConfig(rank=1, targets=ALL_LINEAR))
    adapters = {name for name, _ in every.values()}
    return {keys: name for keys, name in peft_names(layout, model).items()
            if keys[-1][:-len(ADAPTER_SUFFIXES[0])] in adapters}


def _indices(keys: Keys, name: PeftName, model: Any) -> list[tuple[int, int]]:
    """(layer in its stack, expert) of every module a candidate leaf stands for."""
    k = getattr(model, "first_k_dense", 0)
    layers = k if keys[0] == "dense_blocks" else model.n_layers - k
    experts = getattr(model, "n_experts", 0) if "{e}" in name.template else 1
    return [(i, e) for i in range(layers) for e in range(experts)]


def _module(name: PeftName, layer: int, expert: int) -> str:
    return name.module.format(i=layer + name.first, e=expert)


def _zjax_name(module: str) -> str:
    """The ``lora.targets`` name of a module (its last component; Mixtral's experts')."""
    last = module.rsplit(".", 1)[-1]
    return _EXPERT_NAMES.get(last, last)


def _adapter_shapes(model: Any, lora: LoraConfig) -> dict[Keys, tuple[int, ...]]:
    """The adapter leaves of ``model`` built with ``lora``, by keys, with their shapes."""
    import jax
    from flax import nnx

    from zjax.models import model_class

    cls = model_class(model)
    abstract = nnx.eval_shape(lambda: cls(model, rngs=nnx.Rngs(0), lora=lora))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    return {tuple(str(k.key) for k in path): tuple(x.shape) for path, x in flat[0]
            if str(path[-1].key).endswith(ADAPTER_SUFFIXES)}


def _leaf(keys: Keys, shape: tuple[int, ...], name: PeftName, tensors: dict,
          targeted: Callable[[str], bool], rank: int, where: str) -> np.ndarray:
    """One zjax adapter leaf from PEFT's per-layer (and per-expert) tensors, zeros where PEFT
    adapts no module; each tensor taken out of ``tensors``."""
    is_a = keys[-1].endswith(ADAPTER_SUFFIXES[0])
    lead = 2 if "{e}" in name.template else 1
    one = shape[lead:]  # a: [in, r]; b: [r, out] or a fused module's [r, parts, out]
    want = (one[1], one[0]) if is_a else (math.prod(one[1:]), one[0])
    out = np.zeros(shape, np.float32)
    for index in np.ndindex(*shape[:lead]):
        tensor = name.at(index[0], index[-1])
        module = _module(name, index[0], index[-1])
        if not targeted(module):
            if tensor in tensors:
                raise CheckpointError(f"{where}: tensor {tensor!r} is for module {module}, "
                                      "which the adapter's target_modules leaves out")
            continue
        if tensor not in tensors:
            raise CheckpointError(f"{where}: no tensor {tensor!r}, which target_modules "
                                  f"adapts ({module}); the file is incomplete")
        t = tensors.pop(tensor)
        if t.shape != want:
            got_rank = t.shape[0] if is_a else t.shape[-1]
            why = (f"rank {got_rank}, but adapter_config.json says r {rank}"
                   if t.ndim == 2 and got_rank != rank else "another model's width?")
            raise CheckpointError(f"{where}: tensor {tensor!r} is {list(t.shape)}, expected "
                                  f"{list(want)} for this model ({why})")
        out[index] = t.T if is_a else t.T.reshape(one)
    return out
