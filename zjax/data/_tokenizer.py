"""Loading a Hugging Face ``tokenizer.json`` and checking it against a model's vocabulary."""

from __future__ import annotations

import os
from pathlib import Path

from zjax.errors import ConfigError

__all__ = ["check_fits", "id_bound", "load_tokenizer"]


def load_tokenizer(path: str | os.PathLike, *, key: str = "data.tokenizer"):
    """The ``tokenizers.Tokenizer`` saved at ``path`` (a ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise ConfigError(f"{key}: {str(path)!r} is not a file (expected a tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own parse error, one line
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ConfigError(f"{key}: {str(path)!r} is not a tokenizer.json the tokenizers "
                          f"library reads: {why}") from None


def id_bound(tokenizer) -> int:
    """One past the largest id ``tokenizer`` can produce (added tokens included; a
    vocabulary's ids need not be contiguous)."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def check_fits(tokenizer, vocab_size: int, *, tokenizer_path: str | os.PathLike,
               model: str) -> None:
    """Refuse a tokenizer whose ids do not all have a row in the model's embedding.

    Raises:
      ConfigError: naming the tokenizer file, its largest id and the model's vocabulary.
    """
    bound = id_bound(tokenizer)
    if bound > vocab_size:
        raise ConfigError(
            f"{tokenizer_path}: the tokenizer has token ids up to {bound - 1}, but {model} has "
            f"a vocabulary of {vocab_size} (ids 0..{vocab_size - 1}): not this model's "
            "tokenizer (its ids past the vocabulary would have no embedding)")
