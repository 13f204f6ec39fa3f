"""``zjax import-hf`` and ``train.init_from``: a run that starts from given weights.

``import_hf`` converts a Hugging Face Llama or GPT-2 directory, one leaf at a time, into a
directory a run starts from: ``params/`` (an Orbax checkpoint of zjax's params tree, as ``zjax
export`` writes), ``zjax.yaml`` (``loop: llama`` or ``lm``, the ``model`` section read from
``config.json``,
``train.init_from``, and ``data.tokenizer`` when the model came with a ``tokenizer.json``), and
the Hugging Face ``config.json``, ``generation_config.json`` and tokenizer files, kept for
``zjax export --format hf``.

``initial_params`` reads either kind of source (a Hugging Face directory or a params export)
straight into the shards a step's ``from_params`` takes: no device ever holds a whole leaf.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._layout import Layout
from zjax.hf._layouts import layout_for_hf
from zjax.hf._load import HFCheckpoint, is_hf_dir
from zjax.hf._tokenizer import model_tokenizer

__all__ = ["IDENTITY_FILES", "TOKENIZER_FILES", "import_hf", "initial_params"]

log = logging.getLogger("zjax")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "tokenizer.model")
# the model's identity beyond its weights (token ids, generation defaults): kept by import-hf
# and written back by export --format hf
IDENTITY_FILES = ("config.json", "generation_config.json")


def import_hf(hf_dir: str | Path, out: str | Path, *, dtype: str = "float32") -> Path:
    """Convert the Hugging Face model in ``hf_dir`` (Llama, Mistral, Qwen2, Qwen3, Phi-3,
    Gemma, GPT-2: :data:`zjax.hf._layouts.LAYOUTS`) into a new directory ``out`` to train from.

    Args:
      hf_dir: ``config.json`` and PyTorch-layout safetensors (one file or an indexed set).
      out: a new directory (never replaced); it appears whole or not at all.
      dtype: the params' stored dtype (``float32``, as the master copy, or ``bfloat16``).

    Returns:
      ``out``; train with ``zjax train OUT/zjax.yaml``.
    """
    from zjax.checkpoint import check_out, write_orbax_leaves
    from zjax.partition.config import resolve_dtype

    target = resolve_dtype(dtype, key="--dtype")
    source = HFCheckpoint(hf_dir)  # every tensor checked before anything is written
    _check_tokenizer(source)
    out = Path(out).resolve()
    check_out(out, what="import-hf")
    work = out.with_name(f".{out.name}.zjax-import")
    shutil.rmtree(work, ignore_errors=True)  # what an import killed with -9 left
    from zjax.runtime.stop import deferred, interruptible, stop_point

    # SIGINT/SIGTERM under `zjax import-hf` stop it between two leaves, never inside Orbax's
    # writer threads; the partial directory is removed on the way out (zjax.runtime.stop)
    with deferred():
        try:
            work.mkdir()
            write_orbax_leaves(work / "params", interruptible(source.host_leaves(dtype=target)),
                               what="import-hf", shown=out)
            for name in (*IDENTITY_FILES, *TOKENIZER_FILES):
                if (source.directory / name).is_file():
                    shutil.copyfile(source.directory / name, work / name)
            (work / "zjax.yaml").write_text(_run_config(source, out))
            stop_point()
            work.rename(out)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"import-hf: cannot write {str(out)!r}: {e}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("imported %s (%d layers) into %s", hf_dir, source.config.n_layers, out)
    return out


def _check_tokenizer(source: HFCheckpoint) -> None:
    """The tokenizer beside the weights must be a ``tokenizer.json`` (a slow one alone is
    refused) that fits their vocabulary; a model with none is imported with a warning."""
    from zjax.data.tokenize import check_fits, load_tokenizer

    path = model_tokenizer(source.directory, key="import-hf")
    if path is None:
        log.warning("import-hf: %s has no tokenizer.json: the import names no data.tokenizer "
                    "(train it on token ids made with the model's tokenizer, or set "
                    "data.tokenizer), and zjax sample refuses it", source.directory)
        return
    check_fits(load_tokenizer(path, key="import-hf"), source.config.vocab_size,
               tokenizer_path=path, model=f"the model ({source.directory / 'config.json'})")


def _run_config(source: HFCheckpoint, out: Path) -> str:
    # max_seq_len: max_position_embeddings, the model's context (it bounds data.seq_len and
    # sample's length; rotary positions have no table, so a long one costs no memory)
    model = dataclasses.asdict(source.config)
    config: dict[str, Any] = {"loop": source.layout.loop, "model": model,
                              "train": {"init_from": str(out)}}
    from zjax.data import DataConfig

    data: dict[str, Any] = {}
    if model["max_seq_len"] < DataConfig().seq_len:  # the default would not fit
        data["seq_len"] = model["max_seq_len"]
    if (source.directory / "tokenizer.json").is_file():
        data["tokenizer"] = str(out / "tokenizer.json")
    if data:
        config["data"] = data
    head = (f"# zjax import-hf {source.directory}: train with `zjax train {out / 'zjax.yaml'}`"
            " (data.path, optimizer.*, zero.* as for any run)\n")
    if "tokenizer" not in data:
        head += ("# the model came with no tokenizer.json: its data must be token ids made "
                 "with its tokenizer, or set data.tokenizer (text is otherwise read as bytes)\n")
    return head + yaml.safe_dump(config, sort_keys=False)


def initial_params(path: str | Path, target: Any, model: Any) -> Any:
    """The params at ``path`` as global arrays shaped and placed as ``target`` says.

    Args:
      path: a Hugging Face Llama directory, a ``zjax import-hf`` directory, or a params
        export (``zjax export --format orbax``).
      target: a params-shaped tree of ``ShapeDtypeStruct`` with shardings (what a step's
        ``from_params`` takes).
      model: the run's ``model`` section; a Hugging Face config must agree with it.

    Raises:
      ConfigError: ``path`` is none of these, or its weights are not the model's.
    """
    p = Path(path)
    max_len = getattr(model, "max_seq_len", None)
    if is_hf_dir(p) and not (p / "params").is_dir():
        source = HFCheckpoint(p, max_seq_len=max_len)
        _check_model(source.layout, source.config, p, model)
        return source.params(jax.tree.map(lambda a: a.sharding, target))
    if (p / "params").is_dir():
        if (p / "config.json").is_file():  # an import: the values the shapes do not show
            hf = _read_json(p / "config.json")
            layout = layout_for_hf(hf, source=str(p / "config.json"))
            config = layout.from_hf(hf, source=str(p / "config.json"), max_seq_len=max_len)
            _check_model(layout, config, p, model)
        p = p / "params"
    if not (p / "_METADATA").is_file():
        raise ConfigError(
            f"train.init_from: {str(path)!r} is neither a Hugging Face model directory "
            "(config.json and *.safetensors) nor a params export (zjax import-hf, zjax export "
            "--format orbax)")
    return _restore(p.resolve(), target)


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(out).__name__}, not an object")
    return out


def _check_model(layout: Layout, config: Any, directory: Path, model: Any) -> None:
    """The run's ``model`` section must be what the weights are in every key they pin
    (``layout.pinned``: shapes and meaning); the others (``layout.free``: kernels, chunks,
    the data's bound) are the run's."""
    if type(model) is not type(config):
        raise ConfigError(f"train.init_from: {directory} holds a {layout.architecture}; train "
                          f"it with loop: {layout.loop}")
    for field in dataclasses.fields(model):
        key = field.name
        want, got = getattr(config, key), getattr(model, key)
        if key not in layout.free and want != got:  # a field in neither table is pinned
            why = layout.pinned.get(key, "the weights fix it")
            raise ConfigError(f"model.{key}: {got!r}, but the weights in train.init_from "
                              f"({directory}) have {want!r} (its config.json; {why}); "
                              f"set model.{key}: {want!r}")


def _restore(path: Path, target: Any) -> Any:
    """Orbax reads each device's slice of each leaf (cast to float32) into ``target``."""
    import orbax.checkpoint as ocp

    from zjax.checkpoint import item_read

    with item_read():  # no warning about the metadata file an export does not write
        stored = ocp.StandardCheckpointer().metadata(path).item_metadata
    have = {jax.tree_util.keystr(k): tuple(m.shape)
            for k, m in jax.tree_util.tree_flatten_with_path(dict(stored))[0]}
    want = {jax.tree_util.keystr(k): a.shape
            for k, a in jax.tree_util.tree_flatten_with_path(target)[0]}
    for key in sorted(set(want) ^ set(have))[:1]:
        owner = "the model" if key in want else "the export"
        raise ConfigError(f"train.init_from: {path}: only {owner} has the param {key}; is it "
                          "an export of this model?")
    for key, shape in want.items():
        if have[key] != tuple(shape):
            raise ConfigError(f"train.init_from: {path}: param {key} is {list(have[key])} "
                              f"there, {list(shape)} in the model (model.* differs)")
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32,
                                                         sharding=a.sharding), target)
    with item_read():
        return ocp.StandardCheckpointer().restore(path, target)
