"""Preference tuning: the ``preference`` section, the DPO / IPO / SimPO / ORPO losses on
sequence log-probabilities, and a model trained on them with its reference (a frozen copy
of the starting weights, the base with adapters off, or precomputed log-probs).

It owns the ``preference`` section (``zjax.preference.config``, light) and imports
``zjax.models``, ``zjax.lora``, ``zjax.nn`` and the runtime; the rest loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.preference.config import METHODS, REFERENCES, PreferenceConfig

_LAZY = {
    "Pairs": "zjax.preference._losses",
    "pair_losses": "zjax.preference._losses",
    "REFERENCE_KEY": "zjax.preference._objective",
    "preference_loss": "zjax.preference._objective",
    "reference_logps": "zjax.preference._objective",
    "REFERENCE": "zjax.preference._trainable",
    "preference_trainable": "zjax.preference._trainable",
    "frozen_copy": "zjax.preference._trainable",
    "with_copy": "zjax.preference._trainable",
}

__all__ = [
    "METHODS",
    "REFERENCE",
    "REFERENCES",
    "REFERENCE_KEY",
    "Pairs",
    "PreferenceConfig",
    "frozen_copy",
    "pair_losses",
    "preference_loss",
    "preference_trainable",
    "reference_logps",
    "with_copy",
]

__getattr__ = exports(__name__, _LAZY)

if TYPE_CHECKING:
    from zjax.preference._losses import Pairs, pair_losses
    from zjax.preference._objective import REFERENCE_KEY, preference_loss, reference_logps
    from zjax.preference._trainable import (
        REFERENCE,
        frozen_copy,
        preference_trainable,
        with_copy,
    )
