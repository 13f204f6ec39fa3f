"""``zjax sample``: text from a run's newest checkpoint or a Hugging Face directory.

Generation is :mod:`zjax.generate`'s (a key/value cache, one ``jit``, temperature and nucleus
sampling; temperature 0 is greedy). Inference runs on one device (params whole: an
export-sized model), not under ZeRO. ``generate``, ``pick`` and ``until_stop`` are re-exported
here for the callers that import them from this module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zjax.checkpoint import nested
from zjax.errors import CheckpointError, ConfigError
from zjax.generate import generate, pick, until_stop

__all__ = ["SEED_LIMIT", "Sampler", "check_seed", "generate", "load_sampler", "pick",
           "until_stop", "utf8"]

log = logging.getLogger("zjax")
# jax.random.key keeps a seed's low 32 bits (without jax_enable_x64): 2**32 draws what 0
# does, -1 what 2**32 - 1 does, and past int64 it raises OverflowError
SEED_LIMIT = 2**32


def check_seed(seed: int) -> None:
    """Raises ConfigError: ``seed`` is not in [0, :data:`SEED_LIMIT`)."""
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"--seed: {seed}; expected an integer in [0, {SEED_LIMIT}) (the "
                          "key of the draws keeps 32 bits of a seed)")


def utf8(text: str) -> bytes:
    """``text`` in UTF-8.

    Raises:
      ConfigError: ``text`` holds a lone surrogate, e.g. from bytes that are not UTF-8 on the
        command line (Python decodes such a byte 0xNN into ``\\udcNN``).
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        what = (f"the byte 0x{bad - 0xdc00:02x}" if 0xdc80 <= bad <= 0xdcff
                else f"the lone surrogate U+{bad:04X}")
        raise ConfigError(f"--prompt: not valid UTF-8 ({what} at character {e.start}); "
                          "give the text in UTF-8") from None


class Sampler:
    """A model and its tokenizer (byte-level when ``tokenizer`` is None).

    Attributes:
      model: the NNX model with its params.
      tokenizer: a ``tokenizers.Tokenizer`` or None.
      source: where it was loaded from (for messages).
      tokenizer_path: its ``tokenizer.json`` (the chat template is beside it), or None.
      stop: the ids that end a continuation (:func:`zjax.hf.stop_ids`: the model's
        ``eos_token_id`` and the tokenizer's ``eos_token``), as transformers stops.
      missing: why the model has no tokenizer where it needs one (a Hugging Face model
        without ``tokenizer.json``): text is refused with it, never read as bytes; the model
        still generates from token ids (:func:`generate`).
    """

    def __init__(self, model: nnx.Module, tokenizer: Any, source: str,
                 tokenizer_path: str | Path | None = None, stop: Sequence[int] = (),
                 missing: str | None = None):
        self.model, self.tokenizer, self.source = model, tokenizer, source
        self.tokenizer_path, self.stop, self.missing = tokenizer_path, tuple(stop), missing

    def _text_ok(self) -> None:
        if self.tokenizer is None and self.missing is not None:
            raise ConfigError(self.missing)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``.

        Raises:
          ConfigError: ``text`` is not valid UTF-8, or the model has no tokenizer it needs.
        """
        data = utf8(text)
        self._text_ok()
        if self.tokenizer is None:
            return list(data)
        # with the tokenizer's own template (a Llama 3 tokenizer.json adds its BOS), as
        # transformers' tokenizer(prompt) does
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        self._text_ok()
        if self.tokenizer is None:
            return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode([int(i) for i in ids])

    def _replies(self, ids: list[int], stop: set[int], *, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, n: int) -> list[str]:
        rows = generate(self.model, np.asarray([ids] * n), max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, key=jax.random.key(seed),
                        stop=sorted(stop))
        return [self.decode(until_stop(row, stop)) for row in rows]

    def __call__(self, prompt: str, *, max_new_tokens: int = 100, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, n: int = 1) -> list[str]:
        """``n`` continuations of ``prompt`` (the prompt excluded), each ending before its
        first stop id (:attr:`stop`).

        Raises:
          ConfigError: ``seed`` is not in [0, 2**32), ``prompt`` is not valid UTF-8 or is
            empty, or the generation is longer than the model's ``max_seq_len``.
        """
        check_seed(seed)
        ids = self.encode(prompt)
        if not ids:
            raise ConfigError("--prompt: empty (it tokenizes to no tokens); give some text")
        return self._replies(ids, set(self.stop), max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, seed=seed, n=n)

    def chat(self, text: str, *, max_new_tokens: int = 100, temperature: float = 1.0,
             top_p: float = 1.0, seed: int = 0, n: int = 1) -> list[str]:
        """``n`` assistant replies to ``text`` as a user turn, rendered with the tokenizer's
        chat template and its generation prompt; each reply ends before its end-of-turn
        token: any of :attr:`stop` or of the template's special tokens.

        Raises:
          ConfigError: no tokenizer or no chat template, or as :meth:`__call__`.
        """
        from zjax.data import load_chat_template

        check_seed(seed)
        self._text_ok()
        if self.tokenizer_path is None:
            raise ConfigError(f"--chat: {self.source} has no tokenizer (a chat needs its "
                              "chat template)")
        template = load_chat_template(self.tokenizer_path, key="--chat")
        prompt = template.render([{"role": "user", "content": utf8(text).decode()}],
                                 add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        stop = {self.tokenizer.token_to_id(t) for t in template.special_tokens.values()}
        return self._replies(ids, {*self.stop, *(i for i in stop if i is not None)},
                             max_new_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p, seed=seed, n=n)


def load_sampler(source: str | Path, *, adapter: str | Path | None = None) -> Sampler:
    """The model and tokenizer at ``source``: a run directory (its newest intact
    checkpoint; a LoRA run's adapters over the base it started from), a ``zjax import-hf``
    directory, or a Hugging Face directory (as ``zjax export --format hf`` writes). A Hugging
    Face model (or a run started from one) samples with its ``tokenizer.json``, never
    byte-level, and stops at its ``eos_token_id``. ``adapter``: a PEFT LoRA directory applied
    over that model.

    Raises:
      ConfigError / CheckpointError: ``source`` is none of these, or cannot be read, or is a
        Hugging Face model without a ``tokenizer.json``.
    """
    from zjax.config import load_config
    from zjax.data.tokenize import check_fits, load_tokenizer
    from zjax.hf import HFCheckpoint, is_hf_dir, stop_ids

    path, lora = Path(source), None
    if (path / "checkpoints").is_dir() and (path / "config.yaml").is_file():
        from zjax.export._export import read_params

        config = load_config(path / "config.yaml")
        loop, cfg, tokenizer = config.loop, config.model, config.data.tokenizer
        params = read_params(path)[1]
        origin = _hf_origin(config.train.init_from)
        if config.lora.enabled:  # the checkpoint holds the adapters: the base read again
            params, lora = _merge(_base_params(config.train.init_from), params), config.lora
    elif (path / "zjax.yaml").is_file() and (path / "params").is_dir():
        config = load_config(path / "zjax.yaml")
        loop, cfg, tokenizer = config.loop, config.model, config.data.tokenizer
        params, origin = _import_params(path), _hf_origin(path)
    elif is_hf_dir(path):
        hf = HFCheckpoint(path)
        loop, cfg, params = hf.layout.loop, hf.config, nested(hf.host_leaves())
        tokenizer, origin = None, path
    else:
        raise ConfigError(f"sample: {str(source)!r} is not a run directory (config.yaml, "
                          "checkpoints/), a zjax import-hf directory, or a Hugging Face "
                          "model directory (config.json, *.safetensors)")
    missing = None
    if tokenizer is None and origin is not None:  # a Hugging Face model: its own tokenizer
        tokenizer, missing = _origin_tokenizer(origin, path)
    if adapter is not None:
        from zjax.hf import layout_for_model, read_peft

        lora, adapters = read_peft(Path(adapter), layout_for_model(loop, cfg), cfg,
                                   key="--adapter")
        params = _merge(params, nested(adapters.items()))
    model = _model(loop, cfg, params, str(source), lora)
    if tokenizer is None:  # a run trained on bytes, or a model with no tokenizer
        if cfg.vocab_size < 256 and missing is None:
            raise ConfigError(f"sample: {source} has no tokenizer and a vocabulary of "
                              f"{cfg.vocab_size} (< 256 bytes)")
        return Sampler(model, None, str(source), missing=missing)
    tk = load_tokenizer(tokenizer, key="sample")
    check_fits(tk, cfg.vocab_size, tokenizer_path=tokenizer, model=f"the model of {source}")
    return Sampler(model, tk, str(source), tokenizer, stop=stop_ids(origin, tk, tokenizer))


def _hf_origin(init_from: str | Path | None) -> Path | None:
    """The Hugging Face model directory (or import) a run started from, if it did."""
    if init_from is None or not (Path(init_from) / "config.json").is_file():
        return None
    return Path(init_from)


def _origin_tokenizer(origin: Path, source: Path) -> tuple[Path | None, str | None]:
    """The ``tokenizer.json`` of the Hugging Face model ``origin`` that ``source`` is (or
    started from), where ``source`` names none itself; or None and why text is refused.

    Raises:
      CheckpointError: ``origin`` has only a slow tokenizer (:func:`zjax.hf.model_tokenizer`).
    """
    from zjax.hf import model_tokenizer

    found = model_tokenizer(origin, key="sample")
    if found is None:
        return None, (
            f"sample: {source} is a Hugging Face model ({origin / 'config.json'}) with no "
            f"tokenizer.json: its ids are the model's tokens, not bytes; put the model's "
            f"tokenizer.json in {origin}" + ("" if origin == source else
                                            " or set data.tokenizer in the run's config"))
    if origin != source:
        log.warning("sample: %s names no data.tokenizer; sampling with %s, the tokenizer of "
                    "the model it started from (train.init_from)", source, found)
    return found, None


def _merge(base: dict, adapters: dict) -> dict:
    """``base`` with ``adapters``' leaves added (nested dicts of the same layout)."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _base_params(init_from: str | None) -> dict:
    """The base a LoRA run trained over, as host arrays (``train.init_from``)."""
    from zjax.hf import HFCheckpoint, is_hf_dir

    if init_from is None:
        raise CheckpointError("sample: the LoRA run trained over its seed's random base "
                              "(train.init_from is empty), which is in no file; only runs "
                              "that started from weights can be sampled with their adapters")
    path = Path(init_from)
    if not path.exists():
        raise CheckpointError(f"sample: the LoRA run's base, train.init_from {init_from}, is "
                              "gone; put it back, or sample its merged export (zjax export "
                              "--format hf) or the base with --adapter")
    if is_hf_dir(path) and not (path / "params").is_dir():
        return nested(HFCheckpoint(path).host_leaves())
    return _import_params(path)


def _import_params(path: Path) -> dict:
    """The params of a ``zjax import-hf`` directory, as host arrays."""
    import orbax.checkpoint as ocp

    from zjax.checkpoint import item_read

    with item_read():
        return ocp.StandardCheckpointer().restore((path / "params").resolve())


def _model(loop: str, cfg: Any, params: dict, source: str, lora=None) -> nnx.Module:
    from zjax.models import model_class

    cls = model_class(cfg)
    if cls is None:
        raise ConfigError(f"sample: {source} trains loop {loop!r}; zjax sample generates "
                          "with the built-in loops (lm, llama)")
    kw = {} if lora is None else {"lora": lora}
    if lora is not None and lora.quantized:  # the base as the run held it: quantized
        from zjax.lora import quantize

        params = dict(params)
        for stack, node in params.items():  # every stack: blocks, DeepSeek's dense_blocks
            if isinstance(node, dict) and isinstance(node.get("layers"), dict):
                layers = dict(node["layers"])
                layers.update({k: quantize(jnp.asarray(layers[k]), lora.base_dtype)
                               for k in cls.LINEAR_WEIGHTS if k in layers})
                params[stack] = {**node, "layers": layers}
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), **kw)))
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
