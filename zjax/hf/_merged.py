"""A LoRA run's weights for ``zjax export --format hf``: the base it trained over (read from
``train.init_from``, as the run read it) with each adapter's update merged in,
``W + scale * A @ B`` computed in float32, then cast to the export's dtype.

The run's checkpoints hold the adapters only; the base comes from where the run took it (a
Hugging Face directory, an ``import-hf`` directory or a params export), one leaf at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zjax.errors import CheckpointError, DamagedCheckpoint
from zjax.hf._load import HFCheckpoint, is_hf_dir
from zjax.lora import dequantize, quantize
from zjax.models import adapted_weights, model_class

__all__ = ["check_base", "merged_leaves"]

log = logging.getLogger("zjax")

Keys = tuple[str, ...]


def merged_leaves(config: Any, state_dir: Path, stored: dict[Keys, tuple]
                  ) -> tuple[dict[Keys, tuple], Callable[[Keys, np.dtype], np.ndarray]]:
    """``(shapes, read)`` of the merged model's leaves: ``read(keys, dtype)`` gives one leaf,
    the base's plus its adapters' update where it has adapters (``stored``: the adapters in
    the checkpoint at ``state_dir``, by keys, with their shapes). The base must be in files
    (:func:`check_base`, which the writer calls before reading any checkpoint)."""
    from zjax.checkpoint import read_leaf

    shapes, read_base = _base(Path(config.train.init_from), config.model)
    lora, cls = config.lora, model_class(config.model)
    scale, adapted = lora.scale, adapted_weights(cls.LORA_MODULES, lora)
    if lora.quantized:
        log.warning("export --format hf: the run trained over a %s base: the export is that "
                    "base dequantized plus the adapters' update", lora.base_dtype)

    def read(keys: Keys, dtype: np.dtype) -> np.ndarray:
        w = _read_base(read_base, keys, config.train.init_from)
        if lora.quantized and keys[-1] in cls.LINEAR_WEIGHTS:  # what the run trained over
            w = np.asarray(dequantize(quantize(w, lora.base_dtype), lora.base_dtype,
                                      w.shape[-2], np.float32))
        adapter, part = adapted.get(keys[-1], (None, -1))
        a, b = ((*keys[:-1], f"{adapter}{s}") for s in ("_lora_a", "_lora_b"))
        if a in stored:  # a stack's layer weight (blocks, DeepSeek's dense_blocks)
            a, b = (read_leaf(state_dir, k, stored[k], np.dtype(np.float32)) for k in (a, b))
            if part >= 0:  # this weight's part of a fused module's b [L, r, parts, out]
                b = b[:, :, part]
            w = w + np.float32(scale) * np.matmul(a, b)  # [L, in, r] @ [L, r, out]
        return w.astype(dtype)

    return shapes, read


def check_base(config: Any) -> None:
    """A LoRA run's base must be in files to merge into (before any checkpoint is read)."""
    if config.train.init_from is None:
        raise CheckpointError(
            "export --format hf: the LoRA run trained over its seed's random base "
            "(train.init_from is empty), which is in no file; export the adapters with "
            "--format peft")
    if not Path(config.train.init_from).exists():
        raise CheckpointError(f"export --format hf: the LoRA run's base, train.init_from "
                              f"{config.train.init_from}, is gone; put it back to merge the "
                              "adapters into it")


def _read_base(read_base: Callable[[Keys], np.ndarray], keys: Keys, base: str) -> np.ndarray:
    """One base leaf; a base that cannot be read is the base's fault, never the run's
    checkpoint's (a DamagedCheckpoint here would send the export to an older checkpoint and
    call an intact one damaged)."""
    try:
        return read_base(keys)
    except DamagedCheckpoint as e:
        raise CheckpointError(f"export --format hf: the LoRA run's base, train.init_from "
                              f"{base}, cannot be read ({'/'.join(keys)}: {e}); nothing "
                              "is wrong with the run's checkpoints") from None


def _base(path: Path, model: Any) -> tuple[dict[Keys, tuple], Callable[[Keys], np.ndarray]]:
    """The base's leaf shapes and a float32 reader of one leaf."""
    if is_hf_dir(path) and not (path / "params").is_dir():
        source = HFCheckpoint(path, max_seq_len=getattr(model, "max_seq_len", None))
        by_keys = {leaf.keys: leaf for leaf in source.leaves}
        return dict(source.shapes), lambda keys: source.read(by_keys[keys])
    return _orbax_base(path / "params" if (path / "params").is_dir() else path)


def _orbax_base(path: Path) -> tuple[dict[Keys, tuple], Callable[[Keys], np.ndarray]]:
    import jax
    import orbax.checkpoint as ocp

    from zjax.checkpoint import item_read, read_leaf

    try:
        with item_read():
            meta = ocp.PyTreeCheckpointer().metadata(path.resolve()).item_metadata
        if meta is None:
            raise ValueError("Orbax finds no metadata of its params")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"export --format hf: the LoRA run's base, train.init_from "
                              f"{path}, is not readable ({e}); nothing is wrong with the run's "
                              "checkpoints") from None
    shapes = {tuple(str(k.key) for k in p): tuple(m.shape)
              for p, m in jax.tree_util.tree_flatten_with_path(dict(meta))[0]}
    f32 = np.dtype(np.float32)
    return shapes, lambda keys: read_leaf(path.resolve(), keys, shapes[keys], f32,
                                          params_only=True)
