"""The data pipeline: token sources (text files as bytes or through a Hugging Face
``tokenizer.json``, ``.npy`` token arrays), ``zjax tokenize``, and the fixed-window batches a
loop's ``data`` yields.

It owns the ``data`` section (``zjax.data.config``, light). It imports ``zjax.errors`` and
``zjax.schema`` only; the pipeline's names load on first use (Grain is not loaded by reading a
config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.data.config import DataConfig

_LAZY = {
    "BYTE_VOCAB": "zjax.data._pipeline",
    "Tokens": "zjax.data._pipeline",
    "check_fits": "zjax.data.tokenize",
    "encode_files": "zjax.data.tokenize",
    "id_bound": "zjax.data.tokenize",
    "load_tokenizer": "zjax.data.tokenize",
    "load_tokens": "zjax.data._pipeline",
    "stdlib_files": "zjax.data._pipeline",
    "text_files": "zjax.data._pipeline",
    "tokenize_files": "zjax.data.tokenize",
    "window_batches": "zjax.data._pipeline",
}

__all__ = [
    "BYTE_VOCAB",
    "DataConfig",
    "Tokens",
    "check_fits",
    "encode_files",
    "id_bound",
    "load_tokenizer",
    "load_tokens",
    "stdlib_files",
    "text_files",
    "tokenize_files",
    "window_batches",
]


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from zjax.data._pipeline import (
        BYTE_VOCAB,
        Tokens,
        load_tokens,
        stdlib_files,
        text_files,
        window_batches,
    )
    from zjax.data.tokenize import (
        check_fits,
        encode_files,
        id_bound,
        load_tokenizer,
        tokenize_files,
    )
