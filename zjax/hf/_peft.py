"""PEFT's LoRA adapter directory (``PeftModel.from_pretrained(base, DIR)`` loads it):
``adapter_config.json`` and ``adapter_model.safetensors``.

A zjax adapter pair ``blocks/layers/{w}_lora_a`` ``[L, in, r]`` and ``{w}_lora_b``
``[L, r, out]`` is, per layer ``i``, PEFT's
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``,
``<module>`` being the Hugging Face name of the adapted weight (``model.layers.{i}.self_attn.
q_proj``: the layout's name for ``blocks/layers/{w}`` without ``.weight``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._layout import Layout
from zjax.hf._safetensors import write_safetensors
from zjax.lora import ADAPTER_SUFFIXES, GPT2_LINEAR_NAMES, LoraConfig

__all__ = ["PEFT_PREFIX", "PeftName", "adapter_config", "peft_names", "peft_tensor",
           "peft_writer"]

PEFT_PREFIX = "base_model.model."
_FACTOR = {"_lora_a": "lora_A", "_lora_b": "lora_B"}


class PeftName(NamedTuple):
    """A zjax adapter leaf's PEFT tensor name: ``template`` with ``{i}`` for the layer (the
    file's layer index: the stack's index plus ``first``, DeepSeek's mixture layers coming
    after its dense ones) and ``{e}`` for a mixture's expert."""

    template: str
    first: int = 0

    def at(self, layer: int, expert: int = 0) -> str:
        """The tensor's name for the stack's layer ``layer`` (and ``expert``)."""
        return self.template.format(i=layer + self.first, e=expert)

    @property
    def module(self) -> str:
        """The module's name in the model, without PEFT's prefix and the factor's suffix."""
        return self.template[len(PEFT_PREFIX):].rsplit(".", 2)[0]


def peft_names(layout: Layout, model) -> dict[tuple[str, ...], PeftName]:
    """zjax adapter leaf keys -> PEFT's tensor name. A module that fuses equal parts
    (GPT-2's ``c_attn``: ``wq``, ``wk``, ``wv``) has one pair named after it
    (``c_attn_lora_a``, ``c_attn_lora_b``)."""
    out = {}
    for leaf in layout.leaves(model):
        if not leaf.hf.endswith(".weight"):
            continue
        module = leaf.hf[:-len(".weight")]  # a mixture's experts': one per layer and expert
        if leaf.part is not None and not isinstance(leaf.part[1], int):
            continue  # parts of unequal widths (Phi-3's qkv_proj): no fused adapter for them
        name = leaf.keys[-1] if leaf.part is None else module.rsplit(".", 1)[-1]
        for suffix in ADAPTER_SUFFIXES:
            keys = (*leaf.keys[:-1], name + suffix)
            out[keys] = PeftName(f"{PEFT_PREFIX}{module}.{_FACTOR[suffix]}.weight", leaf.first)
    return out


def peft_tensor(layer: np.ndarray) -> np.ndarray:
    """One layer of an adapter leaf as PEFT holds it: ``a`` ``[in, r]`` -> ``[r, in]``,
    ``b`` ``[r, out]`` (``[r, parts, out]`` for a fused module) -> ``[parts * out, r]``."""
    return layer.reshape(layer.shape[0], -1).T


def adapter_config(lora: LoraConfig, modules: list[str], base: str | None) -> dict:
    """PEFT's ``adapter_config.json`` for adapters of ``lora`` on ``modules`` (GPT-2's are
    ``Conv1D``, whose weights are ``[in, out]``: ``fan_in_fan_out``)."""
    conv1d = any(m in GPT2_LINEAR_NAMES for m in modules)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(modules), "use_rslora": lora.rslora, "bias": "none",
            "base_model_name_or_path": base, "fan_in_fan_out": conv1d, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_dora": False}


def _tensors(stored: dict, names: dict) -> list[tuple[str, tuple[int, ...], tuple, tuple]]:
    """(PEFT name, its shape, zjax keys, index: (layer,) or (layer, expert)) of every
    adapter tensor, in file order: a leaf's layers one after another (each leaf read
    once)."""
    out = []
    for keys, shape in stored.items():
        if keys not in names:
            raise CheckpointError(
                f"export --format peft: the checkpoint's param {'/'.join(keys)} has no PEFT "
                "name: not an adapter (not a LoRA run?), or one on part of a module this "
                "architecture fuses with unequal parts (Phi-3's qkv_proj, gate_up_proj), "
                "which PEFT adapts whole; export the merged model with --format hf")
        name = names[keys]
        lead = 2 if "{e}" in name.template else 1  # [L, E, ...]: a tensor per layer and expert
        one = shape[lead:]
        per_layer = (int(np.prod(one[1:])), one[0])
        for index in np.ndindex(*shape[:lead]):
            out.append((name.at(index[0], index[-1]), per_layer, keys, index))
    return out


def peft_writer(run_dir: Path) -> Callable:
    """``write(out, state_dir, stored_leaves, dtype)``: the adapters of the LoRA run in
    ``run_dir`` as a PEFT directory at ``out``, for the base it started from
    (``train.init_from``: ``base_model_name_or_path``)."""
    from zjax.hf._export import run_layout

    # the base is only named (base_model_name_or_path): it may have moved
    config, _, layout = run_layout(run_dir, what="--format peft", origin_needed=False)
    return _writer(layout, config.model, config.lora, config.train.init_from)


def _writer(layout: Layout, model, lora: LoraConfig, base: str | None) -> Callable:
    names = peft_names(layout, model)

    def write(out: Path, state_dir: Path, stored, target: np.dtype) -> None:
        from zjax.checkpoint import read_leaf

        if not lora.enabled:
            raise ConfigError("--format peft: the run trained no adapters (lora.rank is 0); "
                              "export its weights with --format hf")
        stored = dict(stored)
        tensors = _tensors(stored, names)

        def values() -> Iterator[np.ndarray]:
            cache: dict = {}
            for _, _, keys, index in tensors:
                if keys not in cache:  # the leaf's layers follow one another
                    cache = {keys: read_leaf(state_dir, keys, stored[keys], np.float32)}
                yield peft_tensor(cache[keys][index]).astype(target)

        modules = sorted({n.split(".")[-3] for n, *_ in tensors})
        work = out.parent.resolve() / f".{out.name}.zjax-export"
        shutil.rmtree(work, ignore_errors=True)
        try:
            work.mkdir()
            write_safetensors(work / "adapter_model.safetensors",
                              [(n, shape, target) for n, shape, _, _ in tensors], values)
            (work / "adapter_config.json").write_text(
                json.dumps(adapter_config(lora, modules, base), indent=2))
            work.rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return write
