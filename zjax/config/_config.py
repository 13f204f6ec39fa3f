"""The experiment config: typed sections and the composite :class:`Config`.

Each part of zjax takes only its own section (``zero``, ``mesh``, ``model``, ...), defined
beside its consumer in a module that imports nothing heavy. All key, type and range checks go
through :mod:`zjax.schema` (from a mapping and on direct construction), so every error names
the dotted key, the value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zjax.checkpoint.config import CheckpointConfig
from zjax.config._loop_name import model_config_of
from zjax.data.config import DataConfig
from zjax.errors import ConfigError
from zjax.lora.config import LoraConfig
from zjax.models.config import GPTConfig
from zjax.partition.config import ZeroConfig
from zjax.preference.config import PreferenceConfig
from zjax.rl.config import RLConfig
from zjax.runtime.config import MeshConfig
from zjax.schema import (
    choices,
    from_dict,
    interval,
    non_negative,
    positive,
    short,
    to_dict,
    validate,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "LoraConfig",
    "OptimizerConfig",
    "PreferenceConfig",
    "RLConfig",
    "TrainConfig",
    "section_types",
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
      init_from: start from these weights instead of a random init (a fine-tune): a Hugging
        Face Llama directory (``config.json``, ``*.safetensors``), a ``zjax import-hf``
        directory, or a params export (``zjax export --format orbax``). Each device reads only
        its own shards. The optimizer state starts fresh; a resumed run ignores it.
    """

    steps: int = positive(300)
    seed: int = interval(0, 2**32, default=0)  # grain's shuffle takes a uint32 seed
    log_every: int = positive(10)
    eval_every: int = non_negative(100)
    eval_batches: int = positive(4)
    grad_accum: int = positive(1)
    on_nonfinite: str = choices("stop", "skip", default="stop")
    max_skips: int = non_negative(10)
    init_from: str | None = None

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
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)

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
        if self.rl.enabled and self.preference.enabled:
            raise ConfigError(f"rl.method: {self.rl.method} and preference.method "
                              f"{self.preference.method} are two objectives; set one")
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
        model_cls = model_config or model_config_of(loop_name)
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
