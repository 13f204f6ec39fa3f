"""The experiment config: typed sections, loading from YAML, dotted overrides, validation.

Each part of zjax takes only its own section (``zero``, ``mesh``, ``model``, ...). All key and
type checks go through :func:`zjax._schema.from_dict`, so every error names the dotted key, the
value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from zjax._schema import choices, from_dict, to_dict
from zjax.errors import ConfigError
from zjax.mesh import MeshConfig
from zjax.models.gpt import GPTConfig
from zjax.partition.config import ZeroConfig

__all__ = [
    "Config",
    "DataConfig",
    "OptimizerConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    batch_size: int = 16  # global, over all data-parallel replicas
    seq_len: int = 128
    path: str | None = None  # None: the .py files of Python's standard library, byte-level
    eval_fraction: float = 0.05

    def __post_init__(self):
        if self.batch_size <= 0:
            raise ConfigError(f"data.batch_size: must be > 0, got {self.batch_size}")
        if self.seq_len <= 0:
            raise ConfigError(f"data.seq_len: must be > 0, got {self.seq_len}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction: must be in [0, 1), got {self.eval_fraction}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with warmup + cosine decay and global-norm clipping."""

    name: str = choices("adamw", "adam", "sgd", default="adamw")
    lr: float = 3e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    warmup_steps: int = 20
    schedule: str = choices("cosine", "constant", default="cosine")

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr: must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps: must be >= 0, got {self.warmup_steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop."""

    steps: int = 300
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    grad_accum: int = 1

    def __post_init__(self):
        for key in ("steps", "log_every", "grad_accum"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key}: must be > 0, got {getattr(self, key)}")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every: must be >= 0, got {self.eval_every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole experiment: one section per part of zjax."""

    model: GPTConfig = dataclasses.field(default_factory=GPTConfig)
    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self):
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len "
                f"{self.model.max_seq_len}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        """Validate a nested mapping (as read from YAML) into a :class:`Config`."""
        return from_dict(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)


def _parse_value(text: str) -> Any:
    """A command-line override value, read as YAML (``1e-3``, ``true``, ``null``, ``[1, 2]``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict (a copy is returned)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. zero.stage=2")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path in seen:
        raise ConfigError(f"base: {path} includes itself through {' -> '.join(map(str, seen))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    parent = _read_yaml((path.parent / base).resolve(), (*seen, path))
    return _merge(parent, data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML experiment file (``base:`` inherits from another file), apply overrides.

    Args:
      path: YAML file, or None for the defaults.
      overrides: ``dotted.key=value`` strings applied on top.
    """
    data = _read_yaml(Path(path).resolve()) if path is not None else {}
    return Config.from_dict(apply_overrides(data, overrides))
