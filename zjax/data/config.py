"""The ``data`` config section, in a module that imports nothing heavy (no Grain): a config
is read and validated without loading the data pipeline."""

from __future__ import annotations

import dataclasses

from zjax.schema import interval, positive, validate

__all__ = ["DataConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The ``data`` section: where tokens come from and how they are batched.

    Attributes:
      batch_size: global batch (sequences per optimizer step, over all replicas).
      seq_len: tokens per sequence (each example holds ``seq_len + 1`` for the shifted targets).
      path: a text file, directory or glob (byte-level), or a ``.npy`` token array; empty for
        the ``.py`` files of Python's standard library.
      eval_fraction: the tail of the token stream held out for evaluation.
      tokenizer: a Hugging Face ``tokenizer.json``: a text ``path`` is tokenized with it as
        it is read (instead of byte-level), and ``model.vocab_size`` must cover its
        vocabulary; for large corpora tokenize once with ``zjax tokenize`` and train on the
        ``.npy``. Empty for byte-level text.
    """

    batch_size: int = positive(16)
    seq_len: int = positive(128)
    path: str | None = None
    eval_fraction: float = interval(0, 1, default=0.05)
    tokenizer: str | None = None

    def __post_init__(self):
        validate(self, "data")
