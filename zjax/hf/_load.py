"""Hugging Face weights -> zjax params, without the model whole anywhere.

With shardings, each leaf is a global array made by ``jax.make_array_from_callback``: every
device's callback reads only its own slice of the memory-mapped safetensors (transposing and
stacking the layers it holds), so a ZeRO-3 run starts from the file with no device and no host
holding a whole leaf. Without shardings a leaf comes back as one host array (``import-hf``
writes them one at a time).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from zjax.errors import CheckpointError
from zjax.hf._defaults import TRANSFORMERS_VERSION, absent
from zjax.hf._layout import Leaf, hf_shape
from zjax.hf._layouts import layout_for_hf
from zjax.hf._safetensors import SafetensorsDir

__all__ = ["HFCheckpoint", "is_hf_dir", "model_shapes"]

log = logging.getLogger("zjax")
# config.json keys that size tensors: where one is left out, a tensor that does not fit names it
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
              "num_local_experts", "num_experts", "moe_intermediate_size", "n_embd", "n_layer",
              "n_head", "n_inner", "n_positions")


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` looks like a Hugging Face model directory (``config.json`` and
    safetensors)."""
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())


def model_shapes(cfg: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The params' shapes of the reference model of ``cfg`` (nothing allocated)."""
    from flax import nnx

    from zjax.models import model_class

    cls = model_class(cfg)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))),
                                          nnx.Param))
    return {tuple(str(k.key) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}


class HFCheckpoint:
    """A Hugging Face model directory (Llama or GPT-2): its config and its tensors, checked
    against each other and against the zjax model they fill.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or a sharded set with
        ``model.safetensors.index.json``) in PyTorch's layout, as on the Hub.
      max_seq_len: the model's ``max_seq_len`` where the weights do not fix it (Llama).

    Attributes:
      layout: the architecture's :class:`~zjax.hf._layout.Layout` (its ``loop`` trains it).
      config: the zjax ``model`` section ``config.json`` implies.

    Raises:
      CheckpointError: a file is missing or unreadable, the config is not a supported
        architecture, or a tensor is missing, unexpected or of the wrong shape (naming it).
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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config}: not JSON: {e}") from None
        except OSError as e:
            raise CheckpointError(f"{config}: cannot be read: {e}") from None
        if not isinstance(hf, dict):
            raise CheckpointError(f"{config}: holds a JSON {type(hf).__name__}, not an object "
                                  "of config keys")
        self.layout = layout_for_hf(hf, source=str(config))
        left_out = absent(hf, self.layout.model_type)
        if left_out:
            log.info("%s leaves out %s: read at transformers %s's %s defaults", config,
                     _listed(left_out), TRANSFORMERS_VERSION, self.layout.model_type)
        # those that size the tensors are named when the tensors do not fit them
        self.defaulted = {k: v for k, v in left_out.items() if k in SHAPE_KEYS}
        try:
            self.config = self.layout.from_hf(hf, source=str(config), max_seq_len=max_seq_len)
        except CheckpointError as e:
            raise CheckpointError(f"{e}{self._defaults_note()}") from None
        self.tensors = SafetensorsDir(self.directory)
        prefix = self.layout.prefix
        self._short = bool(prefix) and not any(n.startswith(prefix)
                                               for n in self.tensors.names())
        self.leaves = self.layout.leaves(self.config)
        self.shapes = model_shapes(self.config)
        self._check()

    def _file_name(self, name: str) -> str:
        """``name`` as this directory's files spell it (without GPT-2's prefix in some)."""
        return name.removeprefix(self.layout.prefix) if self._short else name

    def _check(self) -> None:
        cfg, names = self.config, set()
        for leaf in self.leaves:
            want = hf_shape(leaf, self.shapes[leaf.keys])
            for name in map(self._file_name, leaf.names(self.shapes[leaf.keys])):
                names.add(name)
                if name not in self.tensors:
                    raise CheckpointError(f"{self.directory}: tensor {name!r} is missing "
                                          f"(config.json describes a model that has it"
                                          f"{self._defaults_note()})")
                if self.tensors.shape(name) != want:
                    raise CheckpointError(
                        f"{self.directory}: tensor {name!r} has shape "
                        f"{list(self.tensors.shape(name))}; config.json implies {list(want)}"
                        f"{self._defaults_note()}")
        tied = {self._file_name("lm_head.weight")} if cfg.tie_embeddings else set()
        extra = [n for n in self.tensors.names()
                 if n not in names | tied and not n.endswith(self.layout.ignored)]
        unread = [n for n in extra if self.layout.unread(cfg, n)]
        if unread:  # as transformers loads them: not at all, with a warning
            log.warning("%s: %d tensor(s) %s's model does not read, e.g. %s; not imported",
                        self.directory, len(unread), self.layout.architecture, unread[0])
            extra = [n for n in extra if n not in set(unread)]
        if extra:
            raise CheckpointError(
                f"{self.directory}: {len(extra)} tensor(s) zjax's model has no place for, e.g. "
                f"{extra[0]!r} (another architecture, or a feature zjax lacks"
                f"{self._defaults_note()})")

    def _defaults_note(self) -> str:
        if not self.defaulted:
            return ""
        return (f"; it leaves out {_listed(self.defaulted)}, read at transformers "
                f"{TRANSFORMERS_VERSION}'s {self.layout.model_type} defaults as "
                "from_pretrained reads them: set the model's values in config.json")

    def read(self, leaf: Leaf, index: tuple = (), dtype=np.float32) -> np.ndarray:
        """The zjax leaf ``leaf`` (or its ``index``, a tuple of slices), cast to ``dtype``."""
        shape = self.shapes[leaf.keys]
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if leaf.part is not None:  # a part along the last axis of the tensor
            size = shape[-1]
            start, stop, step = index[-1].indices(size)
            at = leaf.offset(size)
            index = (*index[:-1], slice(start + at, stop + at, step))
        if not leaf.stacked:
            return self._finite(leaf.hf, _slice(self._array(leaf.hf), leaf.transpose, index,
                                                 dtype))
        spans = [range(*index[d].indices(shape[d])) for d in range(leaf.lead)]
        out = None
        for at in itertools.product(*(range(len(r)) for r in spans)):
            # one tensor per layer (and expert), filled in place: no second copy of the leaf
            where = [r[a] for r, a in zip(spans, at, strict=True)]
            where[0] += leaf.first  # the stack's first layer's index in the file
            name = leaf.hf.format(**dict(zip("ie"[:leaf.lead], where, strict=True)))
            one = self._finite(name, _slice(self._array(name), leaf.transpose,
                                            index[leaf.lead:], dtype))
            if out is None:
                out = np.empty((*map(len, spans), *one.shape), dtype)
            out[at] = one
        return out if out is not None else np.empty(
            (*map(len, spans), *shape[leaf.lead:]), dtype)

    def _finite(self, name: str, values: np.ndarray) -> np.ndarray:
        """``values`` (read from tensor ``name``), refused if any is NaN or infinite: such
        weights train and sample nothing but NaN."""
        if not np.isfinite(values).all():
            bad = int(values.size - np.isfinite(values).sum())
            raise CheckpointError(f"{self.directory}: tensor {self._file_name(name)!r} holds "
                                  f"{bad} NaN or infinite value{'s' if bad > 1 else ''} "
                                  "(a damaged or diverged checkpoint)")
        return values

    def _array(self, name: str) -> np.ndarray:
        return self.tensors.array(self._file_name(name))

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
            raise CheckpointError(f"{self.directory}: the run's params and this checkpoint's "
                                  f"differ at {'/'.join(odd)} (is the loop "
                                  f"{self.layout.loop!r}?)")
        for leaf in self.leaves:
            shape = self.shapes[leaf.keys]
            array = jax.make_array_from_callback(
                shape, flat[leaf.keys], lambda index, leaf=leaf: self.read(leaf, index))
            node = out
            for key in leaf.keys[:-1]:
                node = node.setdefault(key, {})
            node[leaf.keys[-1]] = array
        return out


def _listed(keys: dict[str, Any]) -> str:
    return ", ".join(f"{k} (default {v!r})" for k, v in keys.items())


def _slice(array: np.ndarray, transpose: bool, index: tuple, dtype) -> np.ndarray:
    if transpose:  # the file is [out, in]; zjax's index is into [in, out]
        return np.asarray(array[index[::-1]]).T.astype(dtype)
    return np.asarray(array[index]).astype(dtype)
