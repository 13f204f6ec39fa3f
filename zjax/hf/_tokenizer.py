"""A Hugging Face model's tokenizer and stop tokens, as transformers finds them.

zjax reads a tokenizer as ``tokenizer.json`` (the ``tokenizers`` library's file, what
transformers' fast tokenizers load). A directory whose only tokenizer is a slow one
(SentencePiece's ``tokenizer.model``, BPE's ``vocab.json`` and ``merges.txt``) is refused by
name with the one line that writes ``tokenizer.json``; its ids are never read as bytes.

Generation stops where transformers' ``generate`` stops: at any id of
``generation_config.json``'s ``eos_token_id`` (an int or a list: Llama 3's end of turn and of
text, Qwen's, Gemma's ``<end_of_turn>``), with ``config.json``'s and the tokenizer's
``eos_token`` added (transformers reads the model config's where there is no generation
config).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zjax.errors import CheckpointError

__all__ = ["SLOW_TOKENIZERS", "model_tokenizer", "stop_ids"]

# tokenizer files transformers' slow tokenizers read, which zjax does not
SLOW_TOKENIZERS = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "merges.txt", "vocab.txt", "tokenizer.tiktoken")


def model_tokenizer(directory: str | Path, *, key: str) -> Path | None:
    """The ``tokenizer.json`` of the Hugging Face model in ``directory``; None where it has no
    tokenizer at all.

    Raises:
      CheckpointError: it has only a slow tokenizer (``tokenizer.model`` ...), naming the file,
        the missing ``tokenizer.json`` and how to write it.
    """
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return directory / "tokenizer.json"
    slow = [name for name in SLOW_TOKENIZERS if (directory / name).is_file()]
    if slow:
        raise CheckpointError(
            f"{key}: {directory} has {' and '.join(slow)} but no tokenizer.json, the only "
            "tokenizer file zjax reads (its ids are not bytes); write it with transformers: "
            f"python -c \"from transformers import AutoTokenizer as T; "
            f"T.from_pretrained('{directory}').save_pretrained('{directory}')\" (a "
            "SentencePiece tokenizer.model needs pip install sentencepiece), or copy the "
            "model's tokenizer.json from the Hub")
    return None


def stop_ids(model_dir: str | Path | None, tokenizer: Any = None,
             tokenizer_path: str | Path | None = None) -> tuple[int, ...]:
    """The ids that end a generation: ``eos_token_id`` of ``generation_config.json`` and of
    ``config.json`` in ``model_dir`` (an int or a list; null or absent: none), and the
    ``eos_token`` of the ``tokenizer_config.json`` beside ``tokenizer_path`` (by
    ``tokenizer``'s vocabulary).

    Raises:
      CheckpointError: a file is not JSON, or its ``eos_token_id`` is neither an id nor a list
        of ids (naming the file and the value).
    """
    ids: list[int] = []
    for name in ("generation_config.json", "config.json") if model_dir is not None else ():
        path = Path(model_dir) / name
        if path.is_file():
            ids += _eos_ids(path)
    if tokenizer is not None and tokenizer_path is not None:
        from zjax.data import special_token, tokenizer_config

        eos = special_token(tokenizer_config(tokenizer_path), "eos_token")
        token = None if eos is None else tokenizer.token_to_id(eos)
        if token is not None:
            ids.append(int(token))
    return tuple(dict.fromkeys(ids))


def _eos_ids(path: Path) -> list[int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON: {e}") from None
    value = data.get("eos_token_id") if isinstance(data, dict) else None
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{path}: eos_token_id = {value!r}; expected a token id or a "
                              "list of token ids")
    return list(values)
