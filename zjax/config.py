"""The experiment config: typed sections, loading from YAML, dotted overrides, validation.

Each part of zjax takes only its own section (``zero``, ``mesh``, ``model``, ...). All key, type
and range checks go through :mod:`zjax._schema` (from a mapping and on direct construction), so
every error names the dotted key, the value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from zjax import _yaml
from zjax._schema import (
    choices,
    from_dict,
    interval,
    non_negative,
    positive,
    short,
    to_dict,
    validate,
)
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
    "as_config",
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
    lr: float = positive(3e-3)
    b1: float = interval(0, 1, default=0.9)
    b2: float = interval(0, 1, default=0.95)
    eps: float = positive(1e-8)
    weight_decay: float = non_negative(0.1)
    clip_norm: float | None = positive(1.0, none_means="no clipping")
    warmup_steps: int = non_negative(20)
    schedule: str = choices("cosine", "constant", default="cosine")

    def __post_init__(self):
        validate(self, "optimizer")


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
      on_nonfinite: when a step's loss, gradients or new params are not finite: ``stop`` (end
        the run without saving that state; exit 1 naming the step) or ``skip`` (drop that
        update and go on).
      max_skips: with ``on_nonfinite: skip``, stop after more than this many skipped steps in
        a row.
    """

    steps: int = positive(300)
    seed: int = interval(0, 2**32, default=0)  # grain's shuffle takes a uint32 seed
    log_every: int = positive(10)
    eval_every: int = non_negative(100)
    eval_batches: int = positive(4)
    grad_accum: int = positive(1)
    on_nonfinite: str = choices("stop", "skip", default="stop")
    max_skips: int = non_negative(10)

    def __post_init__(self):
        validate(self, "train")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """The ``logging`` section.

    Attributes:
      progress: show a rich progress bar (process 0, on a terminal).
      tensorboard: write TensorBoard event files under the run directory.
    """

    progress: bool = True
    tensorboard: bool = True

    def __post_init__(self):
        validate(self, "logging")


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
        validate(self)
        if not dataclasses.is_dataclass(self.model):
            raise ConfigError(f"model: expected the loop's model config (a dataclass), got "
                              f"{short(self.model)} ({type(self.model).__name__})")
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and self.data.seq_len > max_len:
            raise ConfigError(
                f"data.seq_len: {self.data.seq_len} exceeds model.max_seq_len {max_len}"
            )
        if self.train.eval_every and self.data.eval_fraction == 0:
            raise ConfigError(
                "data.eval_fraction: 0 holds out no data to evaluate on, but train.eval_every "
                f"is {self.train.eval_every}; set data.eval_fraction > 0 (e.g. 0.05) or "
                "train.eval_every=0"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *,
                  model_config: type | None = None) -> Config:
        """Validate a nested mapping (as read from YAML) into a :class:`Config`.

        Args:
          data: ``{section: {key: value}}`` and ``loop``.
          model_config: the dataclass that validates the ``model`` section (default: the
            ``model_config`` of the mapping's ``loop``).
        """
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a mapping of sections, got {short(data)} "
                              f"({type(data).__name__})")
        data = dict(data or {})
        loop_name = data.get("loop", "lm")
        if not isinstance(loop_name, str):
            raise ConfigError(
                f"loop: expected a name like 'lm' or 'pkg.mod:Name', got {short(loop_name)}"
            )
        model_cls = model_config or resolve_loop(loop_name).model_config
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


def _parse_value(text: str, key: str) -> Any:
    """A command-line override value, read as YAML (``1e-3``, ``true``, ``null``, ``[1, 2]``)."""
    try:
        return _yaml.load(text, where=f"override {short(key)}")
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
        node[parts[-1]] = _parse_value(value, key)
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path in seen:
        raise ConfigError(f"base: {path} includes itself through {' -> '.join(map(str, seen))}")
    try:
        data = _yaml.load(path.read_text(), where=f"config file {str(path)!r}") or {}
    except FileNotFoundError:
        named_by = f" (the base: of {str(seen[-1])!r})" if seen else ""
        raise ConfigError(f"config file {str(path)!r}{named_by} does not exist") from None
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
    if not isinstance(base, str) or not base:
        raise ConfigError(f"base: expected the path of a YAML file to inherit from, got "
                          f"{short(base)} ({type(base).__name__}) in {str(path)!r}")
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
    bound_at: dict[str, str] = {}  # gin: where each key was bound
    if path is not None:
        path = Path(path).resolve()
        if path.suffix == ".gin":
            from zjax._gin import read_gin

            data, bound_at = read_gin(path)
        else:
            data = _read_yaml(path)
    try:
        return Config.from_dict(apply_overrides(data, overrides))
    except ConfigError as e:
        if not bound_at:
            raise
        from zjax._gin import locate

        where = locate(str(e), bound_at, {o.split("=", 1)[0].strip() for o in overrides})
        if where is None:
            raise
        raise ConfigError(f"{e} ({where})") from None


def as_config(config: Config | Mapping[str, Any] | str | os.PathLike | None, *,
              model_config: type | None = None) -> Config:
    """The :class:`Config` that ``zjax.train`` was given in any of its accepted forms.

    Args:
      config: a :class:`Config` (returned as it is); a mapping of sections, as a YAML file
        holds them (``{"train": {"steps": 50}}``), validated by the schema; a path to a YAML
        or gin file; or None for the defaults.
      model_config: for a mapping, the dataclass that validates its ``model`` section (the
        ``model_config`` of the loop being trained); default: that of the mapping's ``loop``.

    Raises:
      ConfigError: ``config`` is none of these, or does not validate.
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config, model_config=model_config)
    if config is None or isinstance(config, str | os.PathLike):
        return load_config(config)
    raise ConfigError(f"config: expected a Config, a mapping of sections or the path of a YAML "
                      f"/ gin file, got {short(config)} ({type(config).__name__})")
