"""The ``checkpoint`` config section, in a module that imports nothing heavy (no Orbax)."""

from __future__ import annotations

import dataclasses

from zjax.schema import non_negative, positive, validate

__all__ = ["CheckpointConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``checkpoint`` section.

    Attributes:
      every: save every this many steps (0: only at the last step and on preemption).
      keep: how many of the most recent checkpoints to keep.
      asynchronous: write in the background while training continues.
    """

    every: int = non_negative(100)
    keep: int = positive(3)
    asynchronous: bool = True

    def __post_init__(self):
        validate(self, "checkpoint")
