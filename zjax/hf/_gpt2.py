"""Hugging Face ``GPT2LMHeadModel`` <-> zjax's reference GPT with GPT-2's options
(``model.norm: layer``, ``model.bias: true``, tied embeddings).

GPT-2's projections are ``Conv1D``: the file holds them ``[in, out]``, zjax's layout, so
nothing is transposed. Its attention input projection is fused: ``c_attn`` is q, k and v side
by side (``[D, 3D]`` and a ``[3D]`` bias), three zjax leaves. Checkpoints saved from
``GPT2Model`` (the original ``gpt2`` on the Hub) leave out the ``transformer.`` prefix; the
``attn.bias`` / ``attn.masked_bias`` buffers some hold are not weights.

=================================  ======================================================
zjax leaf                          Hugging Face tensor
=================================  ======================================================
``embed`` [V, D], ``pos`` [P, D]   ``transformer.wte.weight``, ``transformer.wpe.weight``
``blocks/layers/ln1/scale, bias``  ``transformer.h.{i}.ln_1.weight``, ``.bias``
``blocks/layers/wq, wk, wv``       ``transformer.h.{i}.attn.c_attn.weight`` parts 0, 1, 2
``blocks/layers/bq, bk, bv``       ``transformer.h.{i}.attn.c_attn.bias`` parts 0, 1, 2
``blocks/layers/wo``, ``bo``       ``transformer.h.{i}.attn.c_proj.weight``, ``.bias``
``blocks/layers/ln2/scale, bias``  ``transformer.h.{i}.ln_2.weight``, ``.bias``
``blocks/layers/w_up``, ``b_up``   ``transformer.h.{i}.mlp.c_fc.weight``, ``.bias``
``blocks/layers/w_down``, ``b_down`` ``transformer.h.{i}.mlp.c_proj.weight``, ``.bias``
``ln_f/scale``, ``ln_f/bias``      ``transformer.ln_f.weight``, ``.bias``
=================================  ======================================================
"""

from __future__ import annotations

import functools
from typing import Any

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._defaults import with_defaults
from zjax.hf._layout import Layout, Leaf, check_fixed, number
from zjax.hf._pinned import GPT2_FREE, GPT2_PINNED
from zjax.models import GPTConfig

__all__ = ["GPT2", "gpt2_config", "hf_config", "leaves"]

_H, _L = "transformer.h.{i}.", ("blocks", "layers")
LEAVES = (
    Leaf(("embed",), "transformer.wte.weight", False),
    Leaf(("pos",), "transformer.wpe.weight", False),
    Leaf((*_L, "ln1", "scale"), _H + "ln_1.weight", False),
    Leaf((*_L, "ln1", "bias"), _H + "ln_1.bias", False),
    *(Leaf((*_L, f"w{x}"), _H + "attn.c_attn.weight", False, (k, 3)) for k, x in enumerate("qkv")),
    *(Leaf((*_L, f"b{x}"), _H + "attn.c_attn.bias", False, (k, 3)) for k, x in enumerate("qkv")),
    Leaf((*_L, "wo"), _H + "attn.c_proj.weight", False),
    Leaf((*_L, "bo"), _H + "attn.c_proj.bias", False),
    Leaf((*_L, "ln2", "scale"), _H + "ln_2.weight", False),
    Leaf((*_L, "ln2", "bias"), _H + "ln_2.bias", False),
    Leaf((*_L, "w_up"), _H + "mlp.c_fc.weight", False),
    Leaf((*_L, "b_up"), _H + "mlp.c_fc.bias", False),
    Leaf((*_L, "w_down"), _H + "mlp.c_proj.weight", False),
    Leaf((*_L, "b_down"), _H + "mlp.c_proj.bias", False),
    Leaf(("ln_f", "scale"), "transformer.ln_f.weight", False),
    Leaf(("ln_f", "bias"), "transformer.ln_f.bias", False),
)

# gelu_new and gelu_pytorch_tanh are the same tanh approximation (jax.nn.gelu's default)
_FIXED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh", None),
          "scale_attn_weights": (True, None), "scale_attn_by_inverse_layer_idx": (False, None),
          "tie_word_embeddings": (True, None), "add_cross_attention": (False, None)}


def gpt2_config(hf: dict[str, Any], *, source: str, max_seq_len: int | None = None
                ) -> GPTConfig:
    """The ``model`` section (``loop: lm``) for a GPT-2 ``config.json``. The position table
    fixes ``max_seq_len`` (``n_positions``)."""
    hf = with_defaults(hf, "gpt2")  # an absent key: transformers' GPT2Config default
    check_fixed(hf, _FIXED, source=source)
    num = functools.partial(number, hf, source=source)
    try:
        d = num("n_embd", int)
        return GPTConfig(vocab_size=num("vocab_size", int), d_model=d,
                         n_layers=num("n_layer", int), n_heads=num("n_head", int),
                         d_ff=num("n_inner", int, none=True) or 4 * d,
                         max_seq_len=num("n_positions", int), tie_embeddings=True,
                         norm="layer", norm_eps=num("layer_norm_epsilon", float), bias=True)
    except KeyError as e:
        raise CheckpointError(f"{source}: no {e.args[0]!r}; a GPT-2 config.json has it") from None
    except (TypeError, ValueError) as e:  # GPTConfig's own check
        raise CheckpointError(f"{source}: {e}") from None


def hf_config(cfg: GPTConfig, *, dtype: str) -> dict[str, Any]:
    """GPT-2's ``config.json`` of ``cfg``; ConfigError unless it has GPT-2's layout."""
    wrong = {k: v for k, v in (("norm", "layer"), ("bias", True), ("tie_embeddings", True))
             if getattr(cfg, k) != v}
    if wrong:
        got = ", ".join(f"model.{k}: {getattr(cfg, k)!r}" for k in wrong)
        raise ConfigError(f"--format: hf writes the reference GPT as GPT2LMHeadModel, which "
                          f"needs model.norm: layer, model.bias: true, model.tie_embeddings: "
                          f"true; the run has {got}")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_inner": cfg.ff, "n_positions": cfg.max_seq_len,
            "n_ctx": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new", "tie_word_embeddings": True,
            "scale_attn_weights": True, "torch_dtype": dtype}


def leaves(cfg: GPTConfig) -> list[Leaf]:
    return list(LEAVES)


GPT2 = Layout(architecture="GPT2LMHeadModel", model_type="gpt2", loop="lm",
              from_hf=gpt2_config, to_hf=hf_config, leaves=leaves, free=GPT2_FREE,
              pinned=GPT2_PINNED,
              ignored=(".attn.bias", ".attn.masked_bias"), prefix="transformer.")
