"""Hugging Face Llama weights -> zjax params, without the model whole anywhere.

With shardings, each leaf is a global array made by ``jax.make_array_from_callback``: every
device's callback reads only its own slice of the memory-mapped safetensors (transposing and
stacking the layers it holds), so a ZeRO-3 run starts from the file with no device and no host
holding a whole leaf. Without shardings a leaf comes back as one host array (``import-hf``
writes them one at a time).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zjax.errors import CheckpointError
from zjax.hf._llama import Leaf, leaves, llama_config
from zjax.hf._safetensors import SafetensorsDir
from zjax.models import LlamaConfig

__all__ = ["HFCheckpoint", "is_hf_dir"]

_IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved with the weights


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory (``config.json`` and
    safetensors)."""
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())


class HFCheckpoint:
    """A Hugging Face Llama directory: its config and its tensors, checked against each other.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or a sharded set with
        ``model.safetensors.index.json``) in PyTorch's layout, as on the Hub.

    Raises:
      CheckpointError: a file is missing or unreadable, the config is not a supported Llama,
        or a tensor is missing, unexpected or of the wrong shape (naming it).
    """

    def __init__(self, directory: str | Path, *, max_seq_len: int | None = None):
        self.directory = Path(directory)
        config = self.directory / "config.json"
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory (expected a Hugging Face "
                                  "model directory: config.json and *.safetensors)")
        try:
            hf = json.loads(config.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.directory}: no config.json (expected a Hugging Face "
                                  "model directory: config.json and *.safetensors)") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config}: not JSON: {e}") from None
        self.hf_config = hf
        self.config = llama_config(hf, source=str(config), max_seq_len=max_seq_len)
        self.tensors = SafetensorsDir(self.directory)
        self.leaves = leaves(self.config)
        self._check()

    def _check(self) -> None:
        cfg, names = self.config, set()
        for leaf in self.leaves:
            want = hf_shape(leaf, leaf_shape(leaf, cfg))
            for name in leaf.names(cfg.n_layers):
                names.add(name)
                if name not in self.tensors:
                    raise CheckpointError(f"{self.directory}: tensor {name!r} is missing (a "
                                          f"Llama of {cfg.n_layers} layers has it)")
                if self.tensors.shape(name) != want:
                    raise CheckpointError(
                        f"{self.directory}: tensor {name!r} has shape "
                        f"{list(self.tensors.shape(name))}; config.json implies {list(want)}")
        tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
        extra = [n for n in self.tensors.names()
                 if n not in names | tied and not n.endswith(_IGNORED)]
        if extra:
            raise CheckpointError(
                f"{self.directory}: {len(extra)} tensor(s) zjax's Llama has no place for, e.g. "
                f"{extra[0]!r} (biases or another architecture?)")

    def read(self, leaf: Leaf, index: tuple = (), dtype=np.float32) -> np.ndarray:
        """The zjax leaf ``leaf`` (or its ``index``, a tuple of slices), cast to ``dtype``."""
        shape = leaf_shape(leaf, self.config)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not leaf.stacked:
            return _slice(self.tensors.array(leaf.hf), leaf.transpose, index, dtype)
        layers = range(*index[0].indices(shape[0]))
        return np.stack([_slice(self.tensors.array(leaf.hf.format(i=i)), leaf.transpose,
                                index[1:], dtype) for i in layers])

    def host_leaves(self, dtype=np.float32) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
        """``(keys, whole leaf)`` one at a time, in host memory."""
        for leaf in self.leaves:
            yield leaf.keys, self.read(leaf, dtype=dtype)

    def params(self, shardings: Any) -> Any:
        """The params as global arrays placed by ``shardings`` (a params-shaped tree of
        ``Sharding``), each device reading only its slice of the files."""
        out: dict = {}
        flat = {tuple(str(k.key) for k in path): s for path, s in
                jax.tree_util.tree_flatten_with_path(shardings)[0]}
        expected = {leaf.keys for leaf in self.leaves}
        if set(flat) != expected:
            odd = sorted(set(flat) ^ expected)[0]
            raise CheckpointError(f"{self.directory}: the model's params and a Llama's differ "
                                  f"at {'/'.join(odd)} (is the loop 'llama'?)")
        for leaf in self.leaves:
            shape = leaf_shape(leaf, self.config)
            array = jax.make_array_from_callback(
                shape, flat[leaf.keys], lambda index, leaf=leaf: self.read(leaf, index))
            node = out
            for key in leaf.keys[:-1]:
                node = node.setdefault(key, {})
            node[leaf.keys[-1]] = array
        return out


def _slice(array: np.ndarray, transpose: bool, index: tuple, dtype) -> np.ndarray:
    if transpose:  # the file is [out, in]; zjax's index is into [in, out]
        return np.asarray(array[index[::-1]]).T.astype(dtype)
    return np.asarray(array[index]).astype(dtype)


def hf_shape(leaf: Leaf, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one Hugging Face tensor of ``leaf`` (of zjax shape ``shape``)."""
    one = shape[1:] if leaf.stacked else shape
    return tuple(reversed(one)) if leaf.transpose else tuple(one)


def leaf_shape(leaf: Leaf, cfg: LlamaConfig) -> tuple[int, ...]:
    """The zjax shape of ``leaf`` in a Llama of ``cfg`` (as :class:`zjax.models.Llama` builds
    it)."""
    d, hd, n = cfg.d_model, cfg.head_dim, cfg.n_layers
    name = leaf.keys[-1] if leaf.keys[-1] != "scale" else leaf.keys[-2]
    shapes = {"embed": (cfg.vocab_size, d), "head": (d, cfg.vocab_size), "ln_f": (d,),
              "ln1": (d,), "ln2": (d,), "wq": (d, cfg.n_heads * hd), "wk": (d, cfg.kv_heads * hd),
              "wv": (d, cfg.kv_heads * hd), "wo": (cfg.n_heads * hd, d), "w_gate": (d, cfg.ff),
              "w_up": (d, cfg.ff), "w_down": (cfg.ff, d)}
    return (n, *shapes[name]) if leaf.stacked else shapes[name]
