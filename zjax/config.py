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
from zjax.checkpoint import CheckpointConfig
from zjax.data import DataConfig
from zjax.errors import ConfigError
from zjax.loop import resolve_loop
from zjax.mesh import MeshConfig
from zjax.models.gpt import GPTConfig
from zjax.partition.config import ZeroConfig

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: AdamW (or Adam, SGD), warmup, decay, global-norm clipping.

    Attributes:
      name: ``adamw``, ``adam`` or ``sgd``.
      lr: peak learning rate.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's epsilon.
      weight_decay: decoupled weight decay (adamw).
      clip_norm: clip gradients to this global norm; empty for no clipping.
      warmup_steps: linear warmup from 0 to ``lr``.
      schedule: ``cosine`` (decay to lr/10 at the last step) or ``constant`` after warmup.
    """

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
    """The ``train`` section: the loop around the step.

    Attributes:
      steps: optimizer steps to run.
      seed: seeds parameter init and data order.
      log_every: log (and write metrics) every this many steps.
      eval_every: evaluate on the held-out split every this many steps (0: never).
      eval_batches: batches per evaluation.
      grad_accum: micro-batches per step (gradient accumulation).
    """

    steps: int = 300
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    grad_accum: int = 1

    def __post_init__(self):
        for key in ("steps", "log_every", "grad_accum", "eval_batches"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key}: must be > 0, got {getattr(self, key)}")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every: must be >= 0, got {self.eval_every}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The ``logging`` section.

    Attributes:
      progress: show a rich progress bar (process 0, on a terminal).
      tensorboard: write TensorBoard event files under the run directory.
    """

    progress: bool = True
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole experiment: one section per part of zjax.

    ``loop`` names what is trained (``lm``, or ``package.module:Name``); the ``model`` section
    is validated by that loop's ``model_config`` dataclass.
    """

    loop: str = "lm"
    model: Any = dataclasses.field(default_factory=GPTConfig)
    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self):
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and self.data.seq_len > max_len:
            raise ConfigError(
                f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len {max_len}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        """Validate a nested mapping (as read from YAML) into a :class:`Config`."""
        data = dict(data or {})
        loop_name = data.get("loop", "lm")
        if not isinstance(loop_name, str):
            raise ConfigError(
                f"loop: expected a name like 'lm' or 'pkg.mod:Name', got {loop_name!r}"
            )
        model_cls = resolve_loop(loop_name).model_config
        data["model"] = from_dict(model_cls, data.get("model"), prefix="model")
        return from_dict(cls, data)

    def to_dict(self) -> dict:
        return to_dict(self)


def section_types(model_cls: type = GPTConfig) -> dict[str, type]:
    """The dataclass of every config section, ``model`` being ``model_cls`` (the loop's)."""
    types = {f.name: f.default_factory().__class__ for f in dataclasses.fields(Config)
             if f.default_factory is not dataclasses.MISSING}
    types["model"] = model_cls
    return types


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
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{where}: {problem}"
            + (f" ({context})" if context else "")
        ) from None
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
    """Load a YAML or gin experiment file, then apply dotted overrides.

    A YAML file may name a ``base:`` file to inherit from; a ``.gin`` file binds the same
    sections (``zero.stage = 3``) and ``experiment.loop``.

    Args:
      path: ``.yaml`` / ``.gin`` file, or None for the defaults.
      overrides: ``dotted.key=value`` strings applied on top.
    """
    data: dict = {}
    if path is not None:
        path = Path(path).resolve()
        if path.suffix == ".gin":
            from zjax._gin import read_gin

            data = read_gin(path)
        else:
            data = _read_yaml(path)
    return Config.from_dict(apply_overrides(data, overrides))
