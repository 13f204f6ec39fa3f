"""The data pipeline: token streams (text files as bytes or through a Hugging Face
``tokenizer.json``, ``.npy`` token arrays) cut into windows, and documents (JSON lines, Parquet,
Arrow and ``datasets`` directories, ``zjax tokenize`` output) in the ``text``, ``chat`` and
``prompt_completion`` formats, with loss masks, packed into windows with segment ids: the
batches a loop's ``data`` yields; ``preference`` pairs (TRL's layouts), a pair's chosen
and rejected sequences side by side in each batch (:func:`preference_batches`); and
``prompt`` rows for reinforcement learning (TRL's ``GRPOTrainer`` datasets: the prompts'
ids and their other columns, :func:`load_prompts`, in batches of indices,
:func:`prompt_batches`).

It owns the ``data`` section (``zjax.data.config``, light). It imports ``zjax.errors`` and
``zjax.schema`` only; the pipeline's names load on first use (Grain is not loaded by reading a
config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.data.config import FORMATS, DataConfig

_LAZY = {
    "BYTE_VOCAB": "zjax.data._pipeline",
    "ChatTemplate": "zjax.data._chat",
    "Corpus": "zjax.data._records",
    "Documents": "zjax.data._store",
    "Encoder": "zjax.data._documents",
    "abstract_documents_batch": "zjax.data._records",
    "abstract_preference_batch": "zjax.data._pairs",
    "document_batches": "zjax.data._records",
    "load_chat_template": "zjax.data._chat",
    "load_corpus": "zjax.data._records",
    "pack": "zjax.data._packing",
    "PreferenceRows": "zjax.data._pairs",
    "PreferenceStats": "zjax.data._preference",
    "PromptSet": "zjax.data._prompts",
    "gather_columns": "zjax.data._prompts",
    "left_padded": "zjax.data._prompts",
    "load_prompts": "zjax.data._prompts",
    "prompt_batches": "zjax.data._prompts",
    "preference_batches": "zjax.data._pairs",
    "preference_rows": "zjax.data._pairs",
    "special_token": "zjax.data._chat",
    "tokenizer_config": "zjax.data._chat",
    "read_store": "zjax.data._store",
    "tokenize_records": "zjax.data.tokenize",
    "uses_documents": "zjax.data._records",
    "Tokens": "zjax.data._pipeline",
    "check_fits": "zjax.data._tokenizer",
    "encode_files": "zjax.data.tokenize",
    "id_bound": "zjax.data._tokenizer",
    "load_tokenizer": "zjax.data._tokenizer",
    "load_tokens": "zjax.data._pipeline",
    "stdlib_files": "zjax.data._pipeline",
    "text_files": "zjax.data._pipeline",
    "tokenize_files": "zjax.data.tokenize",
    "window_batches": "zjax.data._pipeline",
}

__all__ = [
    "BYTE_VOCAB",
    "FORMATS",
    "ChatTemplate",
    "Corpus",
    "DataConfig",
    "Documents",
    "Encoder",
    "PreferenceRows",
    "PreferenceStats",
    "PromptSet",
    "Tokens",
    "abstract_documents_batch",
    "abstract_preference_batch",
    "check_fits",
    "document_batches",
    "encode_files",
    "gather_columns",
    "id_bound",
    "left_padded",
    "load_chat_template",
    "load_corpus",
    "load_prompts",
    "load_tokenizer",
    "load_tokens",
    "pack",
    "preference_batches",
    "preference_rows",
    "prompt_batches",
    "read_store",
    "special_token",
    "stdlib_files",
    "text_files",
    "tokenize_files",
    "tokenize_records",
    "tokenizer_config",
    "uses_documents",
    "window_batches",
]


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from zjax.data._chat import ChatTemplate, load_chat_template
    from zjax.data._documents import Encoder
    from zjax.data._packing import pack
    from zjax.data._pairs import (
        PreferenceRows,
        abstract_preference_batch,
        preference_batches,
        preference_rows,
    )
    from zjax.data._pipeline import (
        BYTE_VOCAB,
        Tokens,
        load_tokens,
        stdlib_files,
        text_files,
        window_batches,
    )
    from zjax.data._preference import PreferenceStats
    from zjax.data._prompts import (
        PromptSet,
        gather_columns,
        left_padded,
        load_prompts,
        prompt_batches,
    )
    from zjax.data._records import (
        Corpus,
        abstract_documents_batch,
        document_batches,
        load_corpus,
        uses_documents,
    )
    from zjax.data._store import Documents, read_store
    from zjax.data.tokenize import (
        check_fits,
        encode_files,
        id_bound,
        load_tokenizer,
        tokenize_files,
        tokenize_records,
    )
