"""Loading a Hugging Face ``tokenizer.json``, checking it against a model's vocabulary, and
its identity (what ``zjax tokenize`` records of the tokenizer that made its ids).

Identity: two tokenizers are the same when they map the same token strings to the same ids
(``vocab_sha256``: the SHA-256 of the vocabulary, added tokens included, as sorted
``[id, token]`` pairs) and end documents with the same id (``eos_id``, where both have
one). A file saved again (other JSON formatting or key order) is the same tokenizer; its file
digest (``sha256``) is recorded for the messages only. A tokenizer whose merges or
normalizer changed but whose vocabulary did not splits text differently, yet its ids still
mean the same tokens, so ids made with one train correctly under the other.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from zjax.errors import ConfigError

__all__ = ["check_fits", "describe", "different_tokenizer", "id_bound", "load_tokenizer",
           "tokenizer_identity"]


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


def _file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_identity(tokenizer, path: str | os.PathLike, *, eos_id: int | None) -> dict:
    """What a ``zjax tokenize`` output records of the tokenizer that made its ids (the module
    docstring says which of it makes two tokenizers the same)."""
    from zjax.data._chat import special_token, tokenizer_config

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    pairs = sorted((i, t) for t, i in vocab.items())
    config = tokenizer_config(path)
    specials = {}
    for name in ("bos", "pad"):
        token = special_token(config, f"{name}_token")
        specials[f"{name}_id"] = None if token is None else tokenizer.token_to_id(token)
    return {"path": str(Path(path).resolve()), "sha256": _file_sha256(path),
            "vocab_sha256": hashlib.sha256(json.dumps(pairs, ensure_ascii=False)
                                           .encode()).hexdigest(),
            "id_bound": id_bound(tokenizer), "eos_id": eos_id, **specials}


def different_tokenizer(made: dict, given: dict) -> str | None:
    """Why the identities ``made`` and ``given`` are not the same tokenizer (None: they are)."""
    if made.get("vocab_sha256") != given.get("vocab_sha256"):
        return (f"another vocabulary (vocab sha256 {str(made.get('vocab_sha256'))[:12]}, ids "
                f"below {made.get('id_bound')}, vs {str(given.get('vocab_sha256'))[:12]}, ids "
                f"below {given.get('id_bound')}): the same id means another token")
    eos = made.get("eos_id"), given.get("eos_id")
    if None not in eos and eos[0] != eos[1]:  # (one without: documents made without an EOS)
        return (f"another end-of-document id ({made.get('eos_id')} vs {given.get('eos_id')}): "
                "documents end with a token the other does not stop at")
    return None


def describe(identity: dict | None) -> str:
    """``identity`` for a message: its file and digest."""
    if identity is None:
        return "bytes (no tokenizer)"
    return f"{identity.get('path')} (sha256 {str(identity.get('sha256'))[:12]})"
