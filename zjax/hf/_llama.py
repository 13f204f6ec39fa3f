"""Hugging Face Llama-family decoders <-> zjax's reference Llama: config keys and tensor names.

One :class:`Family` per architecture (``_families.py``: Llama, Mistral, Qwen2, Qwen3, Phi-3;
``_gemma.py``: Gemma 1, 2 and 3) says what its ``config.json`` adds to Llama's; this module
reads and writes what they share. The tensors are in PyTorch's layout, as on the Hub:
``nn.Linear`` weights are ``[out, in]`` (zjax stores ``[in, out]``: transposed), embeddings,
biases and norm weights as they are, and each layer's tensors are separate
(``model.layers.{i}...``) where zjax stacks them on a leading layer axis (one ``Stack``).
The names:

=====================================  ===========================================  =========
zjax leaf                              Hugging Face tensor                          transpose
=====================================  ===========================================  =========
``embed`` [V, D]                       ``model.embed_tokens.weight``                no
``blocks/layers/ln1/scale`` [L, D]     ``model.layers.{i}.input_layernorm.weight``  no
``blocks/layers/wq`` [L, D, H*hd]      ``model.layers.{i}.self_attn.q_proj.weight`` yes
``blocks/layers/wk``, ``wv``, ``wo``   ``...self_attn.k_proj``, ``v_proj``, ``o_proj`` yes
``blocks/layers/bq``, ``bk``, ``bv``   ``...self_attn.q_proj.bias`` ... (Qwen2)     no
``blocks/layers/q_norm/scale``, ``k_`` ``...self_attn.q_norm.weight`` ... (Qwen3)   no
``blocks/layers/ln2/scale``            ``...post_attention_layernorm.weight``       no
``blocks/layers/w_gate``, ``w_up``,    ``...mlp.gate_proj``, ``up_proj``,           yes
``w_down``                             ``down_proj``
``blocks/layers/post_attn_norm``, ...   Gemma 2/3's output norms (``_gemma.py``)      no
``ln_f/scale`` [D]                     ``model.norm.weight``                        no
``head`` [D, V] (untied only)          ``lm_head.weight``                           yes
=====================================  ===========================================  =========

Both use the same rotary convention (``rotate_half``: Hugging Face's conversion of Meta's
weights already permuted q and k for it), so no weight is permuted here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from zjax.errors import CheckpointError, ConfigError
from zjax.hf._defaults import with_defaults
from zjax.hf._layout import Layout, Leaf, check_fixed, check_known, number
from zjax.hf._pinned import LLAMA_FREE, LLAMA_PINNED
from zjax.models import LlamaConfig

__all__ = ["ANY", "LEAVES", "Family", "expert_leaves", "family_layout", "leaves", "refusal"]


_L = ("blocks", "layers")
_A = "model.layers.{i}.self_attn."
LEAVES = (
    Leaf(("embed",), "model.embed_tokens.weight", False),
    Leaf((*_L, "ln1", "scale"), "model.layers.{i}.input_layernorm.weight", False),
    *(Leaf((*_L, f"w{x}"), f"{_A}{x}_proj.weight", True) for x in "qkvo"),
    *(Leaf((*_L, f"b{x}"), f"{_A}{x}_proj.bias", False) for x in "qkv"),
    *(Leaf((*_L, f"{x}_norm", "scale"), f"{_A}{x}_norm.weight", False) for x in "qk"),
    Leaf((*_L, "ln2", "scale"), "model.layers.{i}.post_attention_layernorm.weight", False),
    Leaf((*_L, "w_gate"), "model.layers.{i}.mlp.gate_proj.weight", True),
    Leaf((*_L, "w_up"), "model.layers.{i}.mlp.up_proj.weight", True),
    Leaf((*_L, "w_down"), "model.layers.{i}.mlp.down_proj.weight", True),
    Leaf(("ln_f", "scale"), "model.norm.weight", False),
    Leaf(("head",), "lm_head.weight", True),
)

# the config.json keys every family maps (max_position_embeddings bounds the data only)
MAPPED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "intermediate_size", "rope_theta", "rms_norm_eps",
          "tie_word_embeddings", "head_dim", "rope_scaling")
BOUNDS = ("max_position_embeddings",)
# keys with one value zjax's Llama honours: (accepted values; None: left out, the default)
FIXED = {"hidden_act": ("silu", None), "attention_dropout": (0, 0.0, None)}
# the LlamaConfig options that tell the families apart
OPTIONS = ("qkv_bias", "qk_norm", "sliding_window", "mlp_activation", "norm_plus_one",
           "embed_scale", "post_norms", "global_every", "local_rope_theta", "attn_softcap",
           "final_softcap", "query_pre_attn_scalar", "n_experts", "experts_per_token",
           "n_shared_experts", "moe_d_ff", "router_renormalize", "router_score",
           "router_groups", "router_topk_groups", "routed_scaling_factor", "first_k_dense",
           "kv_lora_rank")
ANY = object()  # Family.model: the option may take any value


@dataclasses.dataclass(frozen=True)
class Family:
    """What one architecture's ``config.json`` adds to the shared Llama keys.

    Attributes:
      architecture: ``architectures`` entry (``Qwen2ForCausalLM``).
      model_type: ``model_type`` (``qwen2``).
      fixed: keys with the values zjax honours (see :func:`~zjax.hf._layout.check_fixed`).
      mapped: the family's own keys that ``options`` reads.
      inert: keys that do not change the computation given ``fixed`` (Qwen2's
        ``sliding_window`` while ``use_sliding_window`` is false).
      options: ``(config.json, its path) -> LlamaConfig fields`` of the family's own keys.
      to_hf: ``LlamaConfig -> config.json keys`` of the family's own.
      table: ``LlamaConfig -> [Leaf]``: the tensor names (default Llama's, :data:`LEAVES`;
        Phi-3 fuses some).
      unread: ``(config, tensor name) -> bool``: tensors the family's transformers model does not
        read (:attr:`zjax.hf._layout.Layout.unread`).
      model: the ``LlamaConfig`` options the family has, as ``{field: value}`` (:data:`ANY`:
        any value); a model config with another value, or not the default of an option the
        family does not list, is not of this family.
    """

    architecture: str
    model_type: str
    fixed: dict[str, tuple]
    mapped: tuple[str, ...] = ()
    inert: tuple[str, ...] = ()
    options: Callable[[dict, str], dict] = lambda hf, source: {}
    to_hf: Callable[[LlamaConfig], dict] = lambda cfg: {}
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    table: Callable[[LlamaConfig], tuple[Leaf, ...]] = lambda cfg: LEAVES
    unread: Callable[[LlamaConfig, str], bool] = lambda cfg, name: False


def _rope_scaling(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``model.rope_*`` keys of ``config.json``'s ``rope_scaling`` (None, ``default``,
    Llama 3.1's ``llama3`` or ``linear``); any other kind is refused."""
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_factor": float(scaling["factor"])}
    if kind == "yarn":
        return _yarn_keys(hf, scaling)
    if kind == "longrope":
        return _longrope_keys(hf, scaling)
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope_scaling = {scaling!r} is not supported by zjax "
                              "(it supports None, rope_type 'llama3' (Llama 3.1's), 'linear', "
                              "'yarn' or 'longrope')")
    return {"rope_scaling": "llama3", "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_len": int(scaling["original_max_position_embeddings"])}


# rope_scaling's yarn keys -> the model section's, with transformers' defaults for absent ones
_YARN = {"beta_fast": ("rope_beta_fast", 32.0), "beta_slow": ("rope_beta_slow", 1.0),
         "mscale": ("rope_mscale", 0.0), "mscale_all_dim": ("rope_mscale_all_dim", 0.0),
         "attention_factor": ("rope_attention_factor", None), "truncate": ("rope_truncate", True)}


def _longrope_keys(hf: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's ``rope_type: longrope``: its two factor lists; the attention factor's ``factor``
    is ``max_position_embeddings / original_max_position_embeddings`` where the config has
    the latter (transformers' ``_compute_longrope_parameters``), else ``rope_scaling``'s."""
    original = hf.get("original_max_position_embeddings")
    factor = (hf["max_position_embeddings"] / original if original
              else float(scaling.get("factor") or 1.0))
    out = {"rope_scaling": "longrope", "rope_short_factor": list(scaling["short_factor"]),
           "rope_long_factor": list(scaling["long_factor"]), "rope_factor": factor,
           "rope_original_max_len": int(original or hf["max_position_embeddings"])}
    if scaling.get("attention_factor") is not None:
        out["rope_attention_factor"] = float(scaling["attention_factor"])
    return out


def _yarn_keys(hf: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """``rope_type: yarn`` as the ``model.rope_*`` keys (``original_max_position_embeddings``
    falls back to ``max_position_embeddings``, as transformers reads it)."""
    out = {"rope_scaling": "yarn", "rope_factor": float(scaling["factor"]),
           "rope_original_max_len": int(scaling.get("original_max_position_embeddings")
                                        or hf["max_position_embeddings"])}
    for key, (ours, default) in _YARN.items():
        if scaling.get(key) is not None:  # absent: the model section's default, transformers'
            out[ours] = bool(scaling[key]) if isinstance(default, bool) else float(scaling[key])
    return out


def _config(family: Family, hf: dict[str, Any], *, source: str,
            max_seq_len: int | None = None) -> LlamaConfig:
    """The ``model`` section for a ``config.json`` of ``family`` (as a dict), a key it
    leaves out read at transformers' class default (:mod:`zjax.hf._defaults`).

    Raises:
      CheckpointError: a key zjax does not know, a value it cannot honour, or a missing key
        (naming the key, its value and what zjax supports).
    """
    # an inert key is not held to Llama's value (Gemma 2's hidden_act: its model reads none)
    fixed = {k: v for k, v in {**FIXED, **family.fixed}.items() if k not in family.inert}
    hf = with_defaults(hf, family.model_type)  # an absent key: transformers' class default
    check_known(hf, (*MAPPED, *BOUNDS, *fixed, *family.mapped, *family.inert),
                source=source, architecture=family.architecture)
    check_fixed(hf, fixed, source=source)
    try:
        num = functools.partial(number, hf, source=source)
        heads, width = num("num_attention_heads", int), num("hidden_size", int)
        if heads < 1:
            raise CheckpointError(f"{source}: num_attention_heads = {heads}; expected an "
                                  "integer >= 1")
        head_dim = num("head_dim", int, none=True)  # null: derived, as Mistral's model does
        return LlamaConfig(
            vocab_size=num("vocab_size", int), d_model=width,
            n_layers=num("num_hidden_layers", int), n_heads=heads,
            n_kv_heads=num("num_key_value_heads", int, none=True) or heads,
            head_dim=None if head_dim in (None, width // heads) else head_dim,
            d_ff=num("intermediate_size", int),
            max_seq_len=int(max_seq_len or num("max_position_embeddings", int)),
            rope_theta=num("rope_theta", float), norm_eps=num("rms_norm_eps", float),
            tie_embeddings=num("tie_word_embeddings", bool),
            **_rope_scaling(hf, source), **family.options(hf, source))
    except KeyError as e:
        raise CheckpointError(f"{source}: no {e.args[0]!r}; a {family.architecture} "
                              "config.json has it") from None
    except (TypeError, ValueError) as e:  # LlamaConfig's own check, or a value not a number
        raise CheckpointError(f"{source}: {e}") from None


def refusal(family: Family, cfg: LlamaConfig) -> str | None:
    """Why ``cfg`` is not a model of ``family`` (an option it lacks), or None."""
    defaults = LlamaConfig()
    for field in OPTIONS:
        want = family.model.get(field, getattr(defaults, field))
        if want is not ANY and getattr(cfg, field) != want:
            return (f"{family.architecture} has model.{field} = {want!r}, the run "
                    f"{getattr(cfg, field)!r}")
    return None


def _hf_config(family: Family, cfg: LlamaConfig, *, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as ``family``, weights stored in ``dtype``."""
    why = refusal(family, cfg)
    if why is not None:
        raise ConfigError(why)
    return {
        "architectures": [family.architecture], "model_type": family.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_width, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": _hf_rope_scaling(cfg),
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": dtype,
        **{k: v[0] for k, v in family.fixed.items()}, **family.to_hf(cfg),
    }


def _hf_rope_scaling(cfg: LlamaConfig) -> dict[str, Any] | None:
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_scaling == "longrope":
        out = {"rope_type": "longrope", "short_factor": list(cfg.rope_short_factor),
               "long_factor": list(cfg.rope_long_factor)}
        return out | ({"attention_factor": cfg.rope_attention_factor}
                      if cfg.rope_attention_factor is not None else {})
    if cfg.rope_scaling == "yarn":
        out = {"rope_type": "yarn", "factor": cfg.rope_factor,
               "original_max_position_embeddings": cfg.rope_original_max_len}
        for key, (ours, default) in _YARN.items():
            if getattr(cfg, ours) != default:
                out[key] = getattr(cfg, ours)
        return out
    return None if cfg.rope_scaling is None else {
        "rope_type": "llama3", "factor": cfg.rope_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len}


def expert_leaves(router: str, experts: str, names: tuple[str, str, str]) -> tuple[Leaf, ...]:
    """:data:`LEAVES` with a mixture's MLP: the router ``{router}.weight`` and the experts'
    gate, up and down projections ``{experts}.{e}.{name}.weight`` (``names`` in that order),
    each ``[L, E, ...]`` leaf made of one tensor per layer and expert."""
    mlp = {"w_gate": names[0], "w_up": names[1], "w_down": names[2]}
    out = []
    for leaf in LEAVES:
        name = mlp.get(leaf.keys[-1])
        if name is not None:
            leaf = Leaf(leaf.keys, f"model.layers.{{i}}.{experts}.{{e}}.{name}.weight", True)
        out.append(leaf)
        if leaf.keys[-2:] == ("ln2", "scale"):
            out.append(Leaf((*_L, "router"), f"model.layers.{{i}}.{router}.weight", True))
    return tuple(out)


def leaves(cfg: LlamaConfig, table: tuple[Leaf, ...] = LEAVES) -> list[Leaf]:
    """The leaves of ``cfg``'s params in ``table``: no ``head`` when the embeddings are tied,
    q/k/v biases and head norms only where the model has them."""
    absent = set()
    if cfg.tie_embeddings:
        absent.add("head")
    if not cfg.qkv_bias:
        absent |= {"bq", "bk", "bv"}
    if not cfg.qk_norm:
        absent |= {"q_norm", "k_norm"}
    if not cfg.post_norms:
        absent |= {"post_attn_norm", "post_mlp_norm"}
    return [leaf for leaf in table if not absent & set(leaf.keys)]


def family_layout(family: Family) -> Layout:
    """The :class:`Layout` of a Llama-family architecture (trained by ``loop: llama``)."""
    return Layout(
        architecture=family.architecture, model_type=family.model_type, loop="llama",
        from_hf=lambda hf, *, source, max_seq_len=None: _config(
            family, hf, source=source, max_seq_len=max_seq_len),
        to_hf=lambda cfg, *, dtype: _hf_config(family, cfg, dtype=dtype),
        leaves=lambda cfg: leaves(cfg, family.table(cfg)), free=LLAMA_FREE,
        pinned=LLAMA_PINNED,
        ignored=("rotary_emb.inv_freq",), unread=family.unread,
        mapped=tuple(k for k in (*MAPPED, *family.mapped) if k not in family.inert),
        bounds=BOUNDS)
