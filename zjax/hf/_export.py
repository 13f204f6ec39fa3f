"""``zjax export RUN_DIR OUT --format hf``: a directory ``transformers`` loads
(a Llama-family architecture from ``loop: llama``: the one the run started from, else the first
of :data:`~zjax.hf._layouts.LAYOUTS` that holds the model; ``GPT2LMHeadModel`` from a
GPT-2-shaped ``loop: lm``).

PyTorch-layout safetensors (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` above the shard size, as ``save_pretrained`` writes them),
``config.json`` (the original's, where the run started from a Hugging Face model: every key the
run did not change kept as it was, token ids included), ``generation_config.json`` and the run's
tokenizer files. Each zjax leaf is read once (one leaf in host
memory; the parts of a fused tensor together) and written as its layers' tensors; files are
filled in that order, which safetensors and the index allow (a reader looks tensors up by
name).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zjax.errors import CheckpointError
from zjax.hf._import import IDENTITY_FILES, TOKENIZER_FILES
from zjax.hf._layout import Layout, Leaf, hf_shape
from zjax.hf._layouts import layout_for_hf, layout_for_model
from zjax.hf._merged import check_base, merged_leaves
from zjax.hf._safetensors import INDEX, write_safetensors

__all__ = ["DEFAULT_SHARD_BYTES", "config_json", "hf_writer"]

DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default, "5GB"


def hf_writer(run_dir: Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Callable:
    """``write(out, state_dir, stored_leaves, dtype)`` for the run in ``run_dir``.

    Raises:
      ConfigError: the run's model has no Hugging Face layout (``loop: llama``, or ``loop:
        lm`` with GPT-2's options).
    """
    config, origin, layout = run_layout(run_dir, what="--format hf")
    if config.lora.enabled:  # the base to merge into, before any checkpoint is read
        check_base(config)
    tokenizer = config.data.tokenizer

    def write(out: Path, state_dir: Path, stored, target: np.dtype) -> None:
        from zjax.checkpoint import read_leaf

        stored = dict(stored)
        if config.lora.enabled:  # the checkpoint holds the adapters: merged into the base
            stored, read = merged_leaves(config, state_dir, stored)
        else:
            read = lambda keys, dtype: read_leaf(state_dir, keys, stored[keys], dtype)
        work = out.parent.resolve() / f".{out.name}.zjax-export"
        shutil.rmtree(work, ignore_errors=True)
        try:
            work.mkdir()
            _write_weights(work, stored, read, layout.leaves(config.model), target,
                           max_shard_bytes)
            hf = config_json(layout, config.model, dtype=target.name, origin=origin)
            (work / "config.json").write_text(json.dumps(hf, indent=2))
            for name in IDENTITY_FILES[1:] if origin is not None else ():  # as it was
                if (origin / name).is_file():
                    shutil.copyfile(origin / name, work / name)
            if tokenizer:
                _copy_tokenizer(Path(tokenizer), work, config.model.vocab_size)
            work.rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return write


def run_layout(run_dir: Path, *, what: str, origin_needed: bool = True
               ) -> tuple[Any, Path | None, Layout]:
    """``(config, origin, layout)`` of the run in ``run_dir``: its config, the Hugging Face
    directory it started from (or None) and the architecture it is exported as.
    ``origin_needed``: a ``train.init_from`` that is gone is an error (else: no origin)."""
    from zjax.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"export {what}: {run_dir} has no config.yaml (the run's "
                              "config, which says the model's shape)")
    config = load_config(path)
    gone = config.train.init_from is not None and not Path(config.train.init_from).exists()
    origin = None if gone and not origin_needed else _origin(config.train.init_from)
    return config, origin, layout_for_model(config.loop, config.model,
                                            prefer=_origin_layout(origin))


def _origin(init_from: str | None) -> Path | None:
    """The Hugging Face directory (or ``zjax import-hf`` directory) the run started from."""
    if init_from is None:
        return None
    path = Path(init_from)
    if not path.exists():
        raise CheckpointError(
            f"export --format hf: the run started from train.init_from {init_from}, which is "
            "gone; its config.json and generation_config.json (token ids, generation "
            "settings) would be lost. Put it back, or point train.init_from in the run's "
            "config.yaml at a copy")
    return path if (path / "config.json").is_file() else None


def _original(origin: Path) -> dict:
    """The original's ``config.json`` as a dict."""
    source = origin / "config.json"
    try:
        original = json.loads(source.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"export --format hf: {source} (the original's config.json, "
                              f"kept for its token ids) is not readable JSON: {e}") from None
    if not isinstance(original, dict):
        raise CheckpointError(f"export --format hf: {source} (the original's config.json) "
                              f"holds a {type(original).__name__}, not a JSON object")
    return original


def _origin_layout(origin: Path | None) -> Layout | None:
    """The architecture the run started from (a Mistral stays a Mistral), if it had one."""
    if origin is None:
        return None
    try:
        return layout_for_hf(_original(origin), source=str(origin / "config.json"))
    except CheckpointError:
        return None


def config_json(layout: Layout, model, *, dtype: str, origin: Path | None) -> dict:
    """The exported ``config.json``: ``layout.to_hf(model)``, over the original's where the
    run started from one. A key keeps the original's value (and its absence stays an absence)
    unless the run changed what it means; the weights' dtype is the export's."""
    new = layout.to_hf(model, dtype=dtype)
    if origin is None:
        return new
    source = origin / "config.json"
    original = _original(origin)
    if layout_for_hf(original, source=str(source)) is not layout:  # not what it started as
        return new
    base = layout.from_hf(original, source=str(source))  # the run started from it: it reads
    if type(base) is not type(model):
        return new
    # the fields a run may set apart from the weights (max_seq_len bounds the data only)
    base = dataclasses.replace(base, **{f: getattr(model, f) for f in layout.free})
    unchanged = layout.to_hf(base, dtype=dtype)
    out = dict(original)
    out.update({k: v for k, v in new.items() if unchanged.get(k) != v})
    for key in ("torch_dtype", "dtype"):  # transformers >= 4.56 also reads `dtype`
        if key in original or key in new:
            out[key] = dtype
    return out


def _write_weights(work: Path, stored: dict, read: Callable, leaves: list[Leaf],
                   target: np.dtype, max_shard_bytes: int) -> None:
    """The weights as ``model.safetensors`` (or shards and an index): ``stored`` the leaves'
    shapes by keys, ``read(keys, dtype)`` one leaf."""
    missing = [leaf.keys for leaf in leaves if leaf.keys not in stored]
    if missing:
        raise CheckpointError(f"export --format hf: the checkpoint has no param "
                              f"{'/'.join(missing[0])} (not the run's model?)")
    # a Hugging Face tensor's leaves (parts of a fused one), by name and first layer (two
    # stacks share names: DeepSeek's dense layers and the mixture's)
    groups: dict[tuple[str, int], list[Leaf]] = {}
    for leaf in leaves:
        groups.setdefault((leaf.hf, leaf.first), []).append(leaf)
    plan = [(name, hf_shape(group[0], stored[group[0].keys]))
            for group in groups.values() for name in group[0].names(stored[group[0].keys])]
    files, size = [[]], 0
    for item in plan:
        nbytes = int(np.prod(item[1], dtype=np.int64)) * target.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += nbytes

    def values() -> Iterator[np.ndarray]:
        for group in groups.values():
            yield from _tensors(group, [read(leaf.keys, target) for leaf in group])

    stream = values()
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    for name, items in zip(names, files, strict=True):
        write_safetensors(work / name, [(n, shape, target) for n, shape in items],
                          functools.partial(itertools.islice, stream, len(items)),
                          metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(int(np.prod(s, dtype=np.int64)) for _, s in plan) * target.itemsize
        weight_map = {n: name for name, items in zip(names, files, strict=True)
                      for n, _ in items}
        (work / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=2))


def _tensors(group: list[Leaf], arrays: list[np.ndarray]) -> Iterator[np.ndarray]:
    """The Hugging Face tensors (one per layer when stacked) of one group's leaves; its own
    frame, so the leaves are freed before the next group's are read."""
    lead = group[0].lead  # one tensor per layer (and expert)
    per = [a.reshape(-1, *a.shape[lead:]) for a in arrays] if lead else [[a] for a in arrays]
    for parts in zip(*per, strict=True):  # fused parts side by side on zjax's last axis
        whole = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        yield np.ascontiguousarray(whole.T if group[0].transpose else whole)


def _copy_tokenizer(tokenizer: Path, work: Path, vocab_size: int) -> None:
    from zjax.data.tokenize import check_fits, load_tokenizer

    if not tokenizer.is_file():
        raise CheckpointError(f"export --format hf: the run's data.tokenizer {tokenizer} is "
                              "gone; the export would have no tokenizer")
    check_fits(load_tokenizer(tokenizer, key="data.tokenizer"), vocab_size,
               tokenizer_path=tokenizer, model="the run's model (model.vocab_size)")
    shutil.copyfile(tokenizer, work / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:  # what import-hf kept beside it
        if (tokenizer.parent / name).is_file():
            shutil.copyfile(tokenizer.parent / name, work / name)
