"""A block's linear layers under LoRA: adapters on the ``lora.targets`` modules, the frozen
base stored quantized (``int8``, ``nf4``), and dropout on the adapters' input; and the MLP's
tiling (``model.mlp_chunk``), which depends on whether its weights train.

Both reference blocks mix in :class:`AdaptedLinears` and call ``self._linear(y, name)`` for
every linear weight. A block names its modules in a table, Hugging Face module name -> the
modules it covers, each a tuple of the block's weights (one weight, or several fused in one
module: GPT-2's ``c_attn`` is ``wq``, ``wk``, ``wv``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from zjax.errors import ConfigError, did_you_mean
from zjax.lora import (
    ALL_LINEAR,
    AdapterDropout,
    LoraConfig,
    adapter_pair,
    dequantize,
    lora_matmul,
    merged_weight,
    quantize,
)
from zjax.models._batch import Packing
from zjax.nn import fp8_matmul, model_axis_size
from zjax.nn.fp8 import dequantized
from zjax.nn.mlp import choose_tiling, tiled, tiled_hidden

__all__ = ["AdaptedLinears", "Modules", "adapted_weights", "adapters_off"]

Modules = dict[str, tuple[tuple[str, ...], ...]]


def adapted_weights(modules: Modules, lora: LoraConfig, *, model: str = "this model"
                    ) -> dict[str, tuple[str, int]]:
    """Each adapted weight -> ``(adapter, part)``: its adapter pair's name (``{adapter}_lora_a``,
    ``{adapter}_lora_b``) and its part of a fused module's ``b`` (-1: the weight's own);
    ``model`` names the model in the error for a target it does not have."""
    out = {}
    for hf in lora.targets_in(tuple(modules), model=model):
        for weights in modules[hf]:
            fused = len(weights) > 1
            for part, weight in enumerate(weights):
                out[weight] = (hf if fused else weight, part if fused else -1)
    return out


@contextlib.contextmanager
def adapters_off(model: nnx.Module) -> Iterator[nnx.Module]:
    """``model`` computing as its base while the block is open: every adapted block's
    adapters are left out (a preference loss's reference, with no second copy of the
    weights). The blocks' static adapter tables are emptied and put back after (a ``Stack``
    reads its blocks' tables each time it runs)."""
    blocks = [node for _, node in nnx.iter_graph(model)
              if isinstance(node, AdaptedLinears) and node.lora_of]
    saved = [node.lora_of for node in blocks]
    for node in blocks:
        node.lora_of = ()
    try:
        yield model
    finally:
        for node, table in zip(blocks, saved, strict=True):
            node.lora_of = table


def _check_targets(lora: LoraConfig, modules: Modules, weights: dict, model: str) -> None:
    """Each module ``lora.targets`` lists must have a weight among this block's ``weights``."""
    have = {hf for hf, groups in modules.items() if any(w in weights for g in groups for w in g)}
    for name in lora.targets_in(tuple(modules), model=model):
        if lora.targets != ALL_LINEAR and name not in have:
            raise ConfigError(
                f"lora.targets: {name} is not a linear module of this {model.removeprefix('a ')}"
                f"{did_you_mean(name, sorted(have))}; its linear modules are "
                f"{', '.join(sorted(have))} "
                f"(or {ALL_LINEAR!r})")


class AdaptedLinears:
    """Mixin for an ``nnx.Module`` block whose linear weights may carry adapters."""

    def _init_adapters(self, lora: LoraConfig | None, rngs: nnx.Rngs, *, modules: Modules,
                       axes: dict[str, tuple], model: str, mlp_chunk: int = 0,
                       fp8: str = "none"):
        """``lora.targets``' adapters, drawn after the base weights (whose values are then
        those of the model without adapters); ``axes``: each linear weight's logical axes;
        ``fp8``: ``model.fp8`` (the projections' matmuls)."""
        enabled = lora is not None and lora.enabled
        if enabled and fp8 != "none":
            raise ConfigError(f"model.fp8: {fp8} with adapters (lora.rank {lora.rank}"
                              f"{', lora.base_dtype ' + lora.base_dtype if lora.quantized else ''}"
                              ") is not built yet; use model.fp8: none")
        self.fp8 = fp8 != "none"
        for name in axes if self.fp8 else ():  # what zero.fp8_gather gathers in FP8
            weight = getattr(self, name, None)
            if isinstance(weight, nnx.Param) and weight[...].ndim == 2:  # not the experts'
                weight.set_metadata(fp8=True)
        if enabled and lora.dropout and mlp_chunk:  # a chunk's tokens have lost their rows
            raise ConfigError(f"lora.dropout: {lora.dropout} with model.mlp_chunk "
                              f"{mlp_chunk} (a tiled MLP) is not built yet; set one of them "
                              "to 0")
        self.lora_scale = lora.scale if enabled else None
        self.lora_rate = lora.dropout if enabled else 0.0
        self.quant, self.lora_in, self.lora_of = None, (), ()
        if not enabled:
            return
        # the table names every weight the model family may have; this block has some
        # (DeepSeek's latent attention has no k_proj, a dense MLP no shared experts)
        axes = {name: names for name, names in axes.items() if hasattr(self, name)}
        if lora.quantized:
            self._quantize_base(lora.base_dtype, axes)
        of = {w: entry for w, entry in adapted_weights(modules, lora, model=model).items()
              if w in axes}
        _check_targets(lora, modules, axes, model)
        widths = dict(self.lora_in)
        pairs = list(dict.fromkeys(name for name, _ in of.values()))  # drawn in this order
        for name in pairs:
            weights = [w for w, (n, _) in of.items() if n == name]
            shape = getattr(self, weights[0])[...].shape  # [in, out], or experts' [E, in, out]
            d_in = widths.get(weights[0], shape[-2])  # a quantized weight's rows: not inputs
            a, b = adapter_pair(rngs, d_in, shape[-1], lora, axes[weights[0]],
                                parts=len(weights) if of[weights[0]][1] >= 0 else 0,
                                experts=shape[0] if len(shape) == 3 else 0)
            setattr(self, f"{name}_lora_a", a)
            setattr(self, f"{name}_lora_b", b)
        # static: weight -> (adapter, part, module index: what its dropout mask is drawn for)
        self.lora_of = tuple(sorted((w, (n, p, pairs.index(n))) for w, (n, p) in of.items()))

    def _quantize_base(self, kind: str, axes: dict[str, tuple]):
        """The frozen base's linear weights stored quantized (QLoRA): one ``uint8`` leaf
        each (:mod:`zjax.lora._quant`), dequantized where the block uses it."""
        self.quant = kind
        shapes = {}
        for name, names in axes.items():  # [in, out], or a mixture's [E, in, out]
            w = getattr(self, name)[...]
            shapes[name] = w.shape[-2]
            setattr(self, name, nnx.Param(quantize(w, kind),
                                          out_sharding=(*names[:-2], None, names[-1]),
                                          eager_sharding=False))
        self.lora_in = tuple(sorted(shapes.items()))  # static: the weights' input widths

    def _dropout(self, context: Packing | None, layer) -> AdapterDropout | None:
        """This layer's dropout on its adapters' inputs: in training (the batch carries row
        keys), with ``lora.dropout`` > 0."""
        keys = None if context is None else context.dropout
        if not self.lora_rate or keys is None:
            return None
        return AdapterDropout(self.lora_rate, keys, 0 if layer is None else layer)

    def _base(self, name: str, *, row_parallel: bool = False, dtype=None) -> jax.Array:
        """Weight ``name`` as the base holds it, dequantized (to ``dtype``: the activations',
        or bfloat16) where the base is quantized."""
        w = getattr(self, name).get_value()  # an array, or an FP8-gathered Fp8Weight
        if self.quant is None:
            return w
        if row_parallel and model_axis_size() > 1:
            raise ConfigError(f"lora.base_dtype: {self.quant} under tensor parallelism "
                              "(mesh.model > 1) is not built yet; use bfloat16")
        return dequantize(w, self.quant, dict(self.lora_in)[name],
                          jnp.bfloat16 if dtype is None else dtype)

    def _weight(self, name: str, *, row_parallel: bool = False, dtype=None) -> jax.Array:
        """Weight ``name`` with its adapters' update merged in (a mixture's experts, whose
        grouped matmuls take whole weights); the weight itself where it has none."""
        w = dequantized(self._base(name, row_parallel=row_parallel, dtype=dtype))
        entry = dict(self.lora_of).get(name)
        if entry is None:
            return w
        a, b = (getattr(self, f"{entry[0]}{s}")[...] for s in ("_lora_a", "_lora_b"))
        return merged_weight(w, a, b, self.lora_scale, row_parallel=row_parallel)

    def _tiled(self, mlp: Callable, y, chunk: int, hidden: Callable, ins: tuple[str, ...],
               down: str) -> jax.Array:
        """``mlp(y)`` (the block's MLP) holding ``chunk`` tokens' worth of hidden units at a
        time (``model.mlp_chunk``): over tokens, or sliced over its hidden units (``hidden``
        of slices of the weights ``ins``, then ``down``), or whole, whichever
        :func:`~zjax.nn.mlp.choose_tiling` finds holds the least."""
        ws = [getattr(self, n).get_value() for n in (*ins, down)]
        # FP8 scales each weight whole: never sliced over its hidden units
        how, _ = choose_tiling(
            tokens=y.size // y.shape[-1], d_model=y.shape[-1], d_ff=ws[-1].shape[0],
            chunk=chunk, weight_bytes=sum(w.size * w.dtype.itemsize for w in ws),
            act_bytes=y.dtype.itemsize, trainable=self.lora_scale is None and self.quant is None)
        if how == "hidden" and self.fp8:
            how = "tokens"
        if how == "hidden":
            return tiled_hidden(hidden, y, tuple(ws[:-1]), ws[-1], chunk=chunk)
        return tiled(mlp, y, chunk=chunk if how == "tokens" else 0)

    def _linear(self, y, name: str, *, row_parallel: bool = False,
                drop: AdapterDropout | None = None) -> jax.Array:
        """``y @ w`` for weight ``name``, with its adapters' update where it has them."""
        w = self._base(name, row_parallel=row_parallel, dtype=y.dtype)
        entry = dict(self.lora_of).get(name)
        if entry is None:
            return fp8_matmul(y, w) if self.fp8 else y @ w
        adapter, part, module = entry
        a, b = (getattr(self, f"{adapter}{s}")[...] for s in ("_lora_a", "_lora_b"))
        if part >= 0:  # this weight's part of a fused module's b
            b = b[:, part]
        x = None if drop is None else drop(y, module, row_parallel=row_parallel)
        return lora_matmul(y, w, a, b, self.lora_scale, row_parallel=row_parallel,
                           adapter_input=x)
