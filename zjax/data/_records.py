"""Document sources (records and ``zjax tokenize`` directories) as training batches: each
source's documents, split into train and a held-out tail, packed into windows, shuffled every
epoch, mixed by weight, sliced by process and batched.

A batch is a dict of int32 ``[rows, seq_len + 1]`` arrays: ``tokens``, ``segment_ids``,
``positions`` and ``loss_mask`` (what :func:`zjax.models.lm_loss` reads). The iterator is
grain's, so its ``get_state()`` / ``set_state()`` resume at the exact next batch.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from zjax.data._documents import Encoder
from zjax.data._packing import PaddedWindows, pack, padded_batches
from zjax.data._sources import is_record_file, object_rows, record_files, rows, source_kind
from zjax.data._store import Documents, build_documents, read_store
from zjax.data._tokenizer import id_bound, load_tokenizer
from zjax.data.config import DataConfig
from zjax.errors import ConfigError

__all__ = ["Corpus", "abstract_documents_batch", "document_batches", "load_corpus",
           "uses_documents"]

BATCH_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")


def uses_documents(data: DataConfig, *, read: bool = True) -> bool:
    """Whether ``data.path`` names document sources (records or tokenized directories).

    ``read=False`` decides by the names alone where the files are not there (``zjax plan``
    on another machine than the data's)."""
    if not read and not all(_there(path) for path, _ in data.sources):
        names = [p for path, _ in data.sources for p in ([path] if isinstance(path, str)
                                                          else path or [])]
        return isinstance(data.path, dict) or any(is_record_file(Path(p)) for p in names)
    kinds = {source_kind(path) for path, _ in data.sources}
    several = not isinstance(data.path, str | None)
    if "stream" in kinds and (len(kinds) > 1 or data.format != "text" or several):
        what = (f"data.format {data.format}" if data.format != "text"
                else "a list or mapping of paths")
        raise ConfigError(f"data.path: {data.path!r}: {what} needs records (.jsonl, "
                          ".parquet, .arrow, a datasets directory) or zjax tokenize "
                          "directories; a text or .npy source is one token stream (give "
                          "several text files as a directory or a glob)")
    return kinds != {"stream"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Each source's documents and mixing weight.

    Attributes:
      sources: ``((documents, weight), ...)``.
      vocab_size: one past the largest token id the sources can hold.
    """

    sources: tuple[tuple[Documents, float], ...]
    vocab_size: int

    @property
    def source(self) -> str:
        return " + ".join(d.source for d, _ in self.sources)

    def split(self, name: str, eval_fraction: float) -> tuple[tuple[Documents, float], ...]:
        """Each source's ``train`` documents, or its held-out tail (``eval``)."""
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        out = []
        for docs, weight in self.sources:
            cut = len(docs) - int(len(docs) * eval_fraction)
            out.append((docs.select(0, cut) if name == "train" else docs.select(cut, len(docs)),
                        weight))
        return tuple(out)


def _there(path) -> bool:
    items = [path] if isinstance(path, str) else list(path or [])
    return all(Path(p).exists() for p in items)


def _store(path: str, data: DataConfig) -> Documents:
    from zjax.data._store import check_store_tokenizer

    docs = read_store(path)
    check_store_tokenizer(docs, data.tokenizer, data.eos_token)  # the ids are its ids
    for key in ("format", "train_on_prompt"):
        made = docs.meta.get(key)
        if made is not None and made != getattr(data, key):
            raise ConfigError(f"data.{key}: {getattr(data, key)!r}, but {path} was tokenized "
                              f"with {key} {made!r}; set data.{key}: {made!r} or tokenize "
                              "again")
    if docs.meta.get("format") == "preference":
        _check_cut(docs, path, data)
    return docs


def _check_cut(docs: Documents, path: str, data: DataConfig) -> None:
    """Refuse a ``preference`` directory whose rows were cut to another ``seq_len`` or
    prompt length than ``data``'s (its sequences are cut as they are tokenized)."""
    for key, want in (("seq_len", data.seq_len), ("max_prompt_len", data.prompt_limit)):
        made = docs.meta.get(key)
        if made != want:
            unset = (" (data.seq_len // 2)"
                     if key == "max_prompt_len" and data.max_prompt_len is None else "")
            raise ConfigError(f"data.{key}: {want}{unset}, but {path} was tokenized with "
                              f"{key} {made} (preference rows are cut to fit as they are "
                              f"tokenized); set data.{key}: {made} or tokenize again with "
                              f"--{key.replace('_', '-')} {want}")


def load_corpus(data: DataConfig, source: Any = None) -> Corpus:
    """The documents of ``data.path`` (or of ``source``, a Python dataset: a
    ``datasets.Dataset``, a grain source or a list of records), tokenized with ``data``'s
    format and tokenizer."""
    _not_prompts(data)
    encoder, loaded = None, []
    specs = [(source, 1.0)] if source is not None else data.sources
    for spec, weight in specs:
        if source is None and source_kind(spec) == "store":
            loaded.append((_store(spec, data), weight))
            continue
        encoder = encoder or Encoder(data)
        found = (object_rows(spec, encoder.columns, optional=encoder.optional)
                 if source is not None
                 else rows(record_files(spec), encoder.columns, optional=encoder.optional))
        name = type(spec).__name__ if source is not None else str(spec)
        said = f"{'data source' if source is not None else 'data.path'}: {name}"
        loaded.append((build_documents(encoder.documents(found, source=said),
                                       vocab_size=encoder.vocab_size, source=name,
                                       meta=encoder.meta), weight))
    from zjax.data._store import check_same_tokenizer

    check_same_tokenizer(d for d, _ in loaded)  # never ids of two tokenizers mixed
    vocab = max(d.vocab_size for d, _ in loaded)
    if encoder is None and data.tokenizer is not None:  # tokenized directories only
        vocab = max(vocab, id_bound(load_tokenizer(data.tokenizer)))
    return Corpus(tuple(loaded), vocab)


def _not_prompts(data: DataConfig) -> None:
    """Refuse ``data.format: prompt``: prompts are what completions are generated from."""
    if data.format == "prompt":
        raise ConfigError("data.format: prompt holds prompts to generate completions from, "
                          "not documents to train on; read them with zjax.data.load_prompts "
                          "and batch them with zjax.data.prompt_batches")


def document_batches(corpus: Corpus, data: DataConfig, *, split: str, seed: int,
                     process_index: int = 0, process_count: int = 1
                     ) -> grain.DatasetIterator | None:
    """A checkpointable iterator of this process's ``[batch_size / processes, seq_len + 1]``
    dicts; windows are reshuffled every epoch from ``seed``.

    An ``eval`` split with fewer windows than one batch gives that one batch again and again,
    padded with rows that count for nothing (loss mask 0); one with no window at all gives
    None (no evaluation) and logs a warning. Only a ``train`` split too small for one batch
    is refused.
    """
    _not_prompts(data)
    if data.batch_size % process_count:
        raise ConfigError(f"data.batch_size: {data.batch_size} is not divisible by the "
                          f"{process_count} processes")
    found = []  # (k, windows, weight)
    for k, (docs, weight) in enumerate(corpus.split(split, data.eval_fraction)):
        if split == "eval":
            windows = _eval_windows(docs, data)
            if windows is not None:
                found.append((k, windows, weight))
            continue
        if len(docs) == 0:
            raise ConfigError(_too_few(docs.source, "no document", data))
        windows = pack(docs, seq_len=data.seq_len, packing=data.packing)
        if len(windows) < data.batch_size:
            raise ConfigError(_too_few(docs.source, f"{len(windows)} windows", data))
        found.append((k, windows, weight))
    shard = dict(process_index=process_index, process_count=process_count)
    if not found:
        warn_no_eval(data, corpus.source, "document")
        return None
    if split == "eval" and sum(len(w) for _, w, _ in found) < data.batch_size:
        rows = PaddedWindows([w for _, w, _ in found], data.batch_size, data.seq_len,
                             BATCH_FIELDS)
        return padded_batches(rows, **shard)
    parts = [grain.MapDataset.source(w).shuffle(seed=seed + k).repeat() for k, w, _ in found]
    weights = [weight for _, _, weight in found]
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(data.batch_size // process_count, drop_remainder=True)
    return iter(ds.to_iter_dataset())


def warn_no_eval(data: DataConfig, source: str, what: str) -> None:
    """The one warning of an eval split with no ``what`` (document, preference pair) in it:
    the run goes on without evaluation."""
    logging.getLogger("zjax").warning(
        "data.eval_fraction: the eval split (%s of %s) holds no %s to evaluate on; training "
        "without evaluation (raise data.eval_fraction, or set train.eval_every=0)",
        data.eval_fraction, source, what)


def _eval_windows(docs: Documents, data: DataConfig):
    """The packed windows of a source's held-out documents, or None where there is none (no
    document, or none with a token to evaluate on)."""
    if len(docs) == 0:
        return None
    try:
        windows = pack(docs, seq_len=data.seq_len, packing=data.packing)
    except ConfigError:  # no token under the loss masks
        return None
    return windows if len(windows) else None


def _too_few(source: str, what: str, data: DataConfig) -> str:
    return (f"data.batch_size: {data.batch_size}, but the train split of {source} holds "
            f"{what} (data.seq_len {data.seq_len} + 1 tokens each), fewer than one batch; "
            "lower data.batch_size or data.seq_len, or add data")


def abstract_documents_batch(data: DataConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch of a document source, as ``ShapeDtypeStruct``s (nothing read)."""
    shape = (data.batch_size, data.seq_len + 1)
    return {k: jax.ShapeDtypeStruct(shape, np.int32) for k in BATCH_FIELDS}
