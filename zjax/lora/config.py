"""The ``lora`` config section, in a module that imports nothing heavy."""

from __future__ import annotations

import dataclasses
import math

from zjax.errors import ConfigError, did_you_mean
from zjax.schema import choices, interval, non_negative, positive, short, validate

__all__ = ["ALL_LINEAR", "GPT2_LINEAR_NAMES", "LINEAR_NAMES", "LoraConfig"]

ALL_LINEAR = "all-linear"
# the Hugging Face module names of a decoder's linear layers (the output head is never one):
# the Llama family's, and GPT-2's Conv1D modules (c_attn: q, k and v fused; c_proj: the
# attention's and the MLP's output projections, which PEFT matches by that one name)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_LINEAR_NAMES = ("c_attn", "c_proj", "c_fc")
# DeepSeek's multi-head latent attention (its queries' and keys/values' down and up projections)
MLA_LINEAR_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_KNOWN = (*LINEAR_NAMES, *MLA_LINEAR_NAMES, *GPT2_LINEAR_NAMES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """The ``lora`` section: low-rank adapters trained over a frozen base (PEFT's LoRA).

    Attributes:
      rank: the adapters' rank r; 0 (the default) trains the whole model.
      alpha: the update ``B @ A`` is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with
        ``rslora``).
      rslora: rank-stabilised scaling (PEFT's ``use_rslora``).
      dropout: dropout on the adapter's input (PEFT's ``lora_dropout``), in training only:
        each adapted module draws its own mask per layer, row and step, from
        ``train.seed``, the step and the row's place in the global batch (resume replays it).
      targets: the linear layers that get adapters, by their Hugging Face module names
        (the Llama family's ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
        ``up_proj``, ``down_proj``; DeepSeek's latent attention's ``q_proj`` or ``q_a_proj``
        and ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; GPT-2's
        ``c_attn``, ``c_proj``, ``c_fc``), or
        ``all-linear``: every linear layer of the model but the output head.
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
    dropout: float = interval(0, 1, default=0.0, closed="[)")
    targets: str | list = ALL_LINEAR
    base_dtype: str = choices("bfloat16", "int8", "nf4", default="bfloat16")
    init_adapter: str | None = None

    def __post_init__(self):
        validate(self, "lora")
        for name in self._listed():
            if name not in _KNOWN:
                raise ConfigError(
                    f"lora.targets: {short(name)} is not a linear layer's name"
                    f"{did_you_mean(name, (ALL_LINEAR, *_KNOWN))}; use {ALL_LINEAR!r} or "
                    f"names among {', '.join(_KNOWN)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def quantized(self) -> bool:
        """Whether the base's linear weights are stored quantized (``int8``, ``nf4``)."""
        return self.base_dtype in ("int8", "nf4")

    def _listed(self) -> tuple[str, ...]:
        """The names ``targets`` lists (none for ``all-linear``)."""
        targets = self.targets
        if targets == ALL_LINEAR:
            return ()
        names = [targets] if isinstance(targets, str) else targets
        if not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"lora.targets: expected {ALL_LINEAR!r} or a list of module "
                              f"names, got {short(targets)}")
        return tuple(names)

    def targets_in(self, available: tuple[str, ...], *, model: str = "this model"
                   ) -> tuple[str, ...]:
        """The targeted names among a model's linear modules ``available`` (all of them for
        ``all-linear``).

        Raises:
          ConfigError: a listed name is no linear module of the model.
        """
        if self.targets == ALL_LINEAR:
            return tuple(available)
        names = self._listed()
        for name in names:
            if name not in available:
                raise ConfigError(
                    f"lora.targets: {name} is not a linear module of {model}"
                    f"{did_you_mean(name, available)}; its are {', '.join(available)} "
                    f"(or {ALL_LINEAR!r})")
        return names

    @property
    def scale(self) -> float:
        """The factor of the update: ``alpha / rank``, or ``alpha / sqrt(rank)`` (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
