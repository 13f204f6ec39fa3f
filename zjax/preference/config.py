"""The ``preference`` config section, in a module that imports nothing heavy."""

from __future__ import annotations

import dataclasses

from zjax.errors import ConfigError
from zjax.schema import choices, interval, non_negative, positive, validate

__all__ = ["METHODS", "REFERENCES", "PreferenceConfig"]

METHODS = ("dpo", "ipo", "simpo", "orpo")
REFERENCES = ("model", "precompute", "none")
# the methods that compare the policy with a reference model, and the reference-free ones
_WITH_REFERENCE = ("dpo", "ipo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceConfig:
    """The ``preference`` section: preference tuning on pairs of a chosen and a rejected
    answer (``data.format: preference``), as Hugging Face TRL's trainers define the losses.

    Attributes:
      method: the loss; empty (the default) trains next-token prediction. ``dpo`` (Rafailov et
        al. 2023: ``-log sigmoid(beta * margin)``, the margin being the chosen answer's
        log-probability ratio to the reference less the rejected one's), ``ipo`` (Azar et
        al. 2023: ``(margin - 1 / (2 beta))^2`` over length-averaged log-probabilities),
        ``simpo`` (Meng et al. 2024: reference-free, ``-log sigmoid(beta * (avg chosen -
        avg rejected) - gamma)``), ``orpo`` (Hong et al. 2024: reference-free, the chosen
        answer's NLL plus ``beta`` times ``-log sigmoid`` of the log odds ratio).
      beta: the inverse temperature of DPO, IPO's regulariser, SimPO's reward scale, ORPO's
        lambda (the weight of the odds-ratio term, TRL's ``ORPOConfig.beta``).
      label_smoothing: the probability that a pair's labels are flipped (conservative DPO,
        Mitchell 2023; TRL's ``label_smoothing``): DPO and SimPO.
      gamma: SimPO's target reward margin (TRL's ``simpo_gamma``).
      sft_weight: the weight of an added NLL term on the chosen answer (its length-averaged
        negative log-likelihood; TRL's ``rpo_alpha`` for DPO, ``cpo_alpha`` for SimPO); empty:
        1 for ``orpo`` (its SFT term), 0 for the others.
      reference: where the reference log-probabilities come from (``dpo``, ``ipo``):
        ``model``, a frozen copy of the starting weights stored in ``zero.gather_dtype``,
        placed like the policy (sharded over ``data`` at stage 3, gathered on use by the same
        layer schedule) with no gradients or optimizer state; with ``lora.rank`` > 0 the base
        with the adapters switched off (no second copy). ``precompute``: one pass over the
        train split with the starting weights before training stores each sequence's
        log-probability next to its tokens, so no reference is held during training.
        ``none`` for ``simpo`` and ``orpo``. Empty: ``model`` for ``dpo`` and ``ipo``,
        ``none`` for the others.
    """

    method: str | None = choices(None, *METHODS, default=None)
    beta: float = positive(0.1)
    label_smoothing: float = interval(0, 0.5, default=0.0, closed="[)")
    gamma: float = non_negative(0.5)
    sft_weight: float | None = non_negative(None, none_means="1 for orpo, 0 otherwise")
    reference: str | None = choices(None, *REFERENCES, default=None)

    def __post_init__(self):
        validate(self, "preference")
        if self.method is None:
            return
        needs = self.method in _WITH_REFERENCE
        if needs and self.reference == "none":
            raise ConfigError(f"preference.reference: none, but preference.method "
                              f"{self.method} compares the policy with a reference; use model "
                              "or precompute (or method simpo / orpo, which need none)")
        if not needs and self.reference not in (None, "none"):
            raise ConfigError(f"preference.reference: {self.reference}, but preference.method "
                              f"{self.method} is reference-free; leave it empty or set none")
        if self.label_smoothing and self.method not in ("dpo", "simpo"):
            raise ConfigError(f"preference.label_smoothing: {self.label_smoothing} applies to "
                              f"dpo and simpo, not {self.method}; set it to 0")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def source(self) -> str:
        """Where the reference comes from: ``model``, ``precompute`` or ``none``."""
        if self.reference is not None:
            return self.reference
        return "model" if self.method in _WITH_REFERENCE else "none"

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen answer's NLL term."""
        if self.sft_weight is not None:
            return self.sft_weight
        return 1.0 if self.method == "orpo" else 0.0
