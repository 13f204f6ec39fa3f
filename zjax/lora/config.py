"""The ``lora`` config section, in a module that imports nothing heavy."""

from __future__ import annotations

import dataclasses
import math

from zjax.errors import ConfigError, did_you_mean
from zjax.schema import choices, interval, non_negative, positive, short, validate

__all__ = ["ALL_LINEAR", "LINEAR_NAMES", "LoraConfig"]

ALL_LINEAR = "all-linear"
# the Hugging Face module names of a decoder's linear layers (the output head is never one)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """The ``lora`` section: low-rank adapters trained over a frozen base (PEFT's LoRA).

    Attributes:
      rank: the adapters' rank r; 0 (the default) trains the whole model.
      alpha: the update ``B @ A`` is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with
        ``rslora``).
      rslora: rank-stabilised scaling (PEFT's ``use_rslora``).
      dropout: dropout on the adapter's input (PEFT's ``lora_dropout``).
      targets: the linear layers that get adapters, by their Hugging Face module names
        (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
        ``down_proj``), or ``all-linear``: every linear layer but the output head.
      base_dtype: how the frozen base is stored and gathered: ``bfloat16`` (LoRA), or its
        linear weights quantized over blocks of 64 inputs with one float32 absmax each:
        ``int8`` or ``nf4`` (QLoRA's NormalFloat4); its other leaves stay bfloat16.
      init_adapter: a PEFT LoRA directory to start the adapters from (its rank, alpha,
        rsLoRA and targets must be this section's), over the base of ``train.init_from``;
        empty: PEFT's initialisation (B zeros).
    """

    rank: int = non_negative(0)
    alpha: float = positive(8.0)
    rslora: bool = False
    dropout: float = interval(0, 1, default=0.0)
    targets: str | list = ALL_LINEAR
    base_dtype: str = choices("bfloat16", "int8", "nf4", default="bfloat16")
    init_adapter: str | None = None

    def __post_init__(self):
        validate(self, "lora")
        for name in self.target_names:
            if name not in LINEAR_NAMES:
                raise ConfigError(
                    f"lora.targets: {short(name)} is not a linear layer's name"
                    f"{did_you_mean(name, (ALL_LINEAR, *LINEAR_NAMES))}; use {ALL_LINEAR!r} or "
                    f"names among {', '.join(LINEAR_NAMES)}")
        if self.dropout:
            raise ConfigError(
                f"lora.dropout: {self.dropout}: dropout on the adapters' input is not built "
                "yet (the step takes no random key); use 0")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def quantized(self) -> bool:
        """Whether the base's linear weights are stored quantized (``int8``, ``nf4``)."""
        return self.base_dtype in ("int8", "nf4")

    @property
    def target_names(self) -> tuple[str, ...]:
        """The targeted module names (every one for ``all-linear``)."""
        targets = self.targets
        if targets == ALL_LINEAR:
            return LINEAR_NAMES
        names = [targets] if isinstance(targets, str) else targets
        if not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"lora.targets: expected {ALL_LINEAR!r} or a list of module "
                              f"names, got {short(targets)}")
        return tuple(names)

    @property
    def scale(self) -> float:
        """The factor of the update: ``alpha / rank``, or ``alpha / sqrt(rank)`` (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
