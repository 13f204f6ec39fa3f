"""``Stack``: L identical NNX blocks with stacked params, run as one scheduled unit.

Outside zjax (or at ZeRO stages 0-2) a ``Stack`` is a plain ``lax.scan`` over its layers with
per-layer ``jax.checkpoint``. Inside a zjax stage-3 step the step binds a *runner* to each
``Stack`` (:func:`bind_runners`), and ``__call__`` hands its stacked shards and a pure per-layer
function to the scheduled layer scan. Params cross that boundary as pure dicts
(``nnx.to_pure_dict``), the same layout zjax uses for the whole model.

Layers that differ by kind but not by shape (Gemma's sliding-window layers between global ones)
stay one stack: with ``indexed=True`` each block is called with ``layer=i``, its index (traced:
the scan's per-iteration input), and picks its kind from it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

__all__ = ["Stack", "bind_runners", "iter_stacks", "layer_only"]

# while set, a Stack built creates only this layer (leading axis of one): see layer_only
_ONLY: contextvars.ContextVar = contextvars.ContextVar("zjax_stack_layer_only", default=None)


@contextlib.contextmanager
def layer_only(index: Any) -> Iterator[None]:
    """Every :class:`Stack` built inside creates only its layer ``index`` (an int, or an
    int32 scalar traced in the program that builds the model), with the values that layer
    has in the whole Stack, its params' leading axis one long; the modules built after a
    Stack get the keys they get in the whole model. What builds a model too large to hold
    uses it to initialise one layer at a time (the streamed step's init)."""
    token = _ONLY.set(index)
    try:
        yield
    finally:
        _ONLY.reset(token)

Runner = Callable[[Callable, dict, jax.Array], jax.Array]


class Stack(nnx.Module):
    """``n_layers`` copies of the block built by ``make_layer``, params stacked on axis 0.

    Args:
      make_layer: ``make_layer(rngs) -> nnx.Module``; the block maps ``x -> y`` with ``y``
        like ``x`` (an array, or a pytree of arrays: a mixture of experts' ``(x, router
        statistics)``, summed over the layers) and holds only ``nnx.Param`` state.
      n_layers: number of layers L.
      rngs: NNX RNGs; split so every layer is initialised differently.
      remat: checkpoint each layer in the plain scan (recompute it in the backward pass).
      indexed: call each block as ``block(h, ..., layer=i)`` with its index ``i`` (an int32
        scalar); a runner gets the indices ``[L]`` as ``index=`` and passes ``index=i`` on.
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], n_layers: int, *,
                 rngs: nnx.Rngs, remat: bool = True, indexed: bool = False):
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs):
            return make_layer(rngs)

        only = _ONLY.get()
        if only is None:
            self.layers = nnx.split_rngs(splits=n_layers)(create)(rngs)
        else:  # the same split keys (the parent stream advanced alike), one layer's taken
            graphdef, keys = nnx.split(nnx.split_rngs(rngs, splits=n_layers,
                                                      graph_updates=False))
            keys = jax.tree.map(lambda k: lax.dynamic_slice_in_dim(k, only, 1)
                                if jnp.ndim(k) else k, keys)
            self.layers = create(nnx.merge(graphdef, keys))
        self.n_layers = n_layers
        self.remat = remat
        self.indexed = indexed
        self.runner: Runner | None = None

    def __call__(self, x: Any, context: Any = None) -> Any:
        """``x`` through every layer; ``context`` (packed documents' segment ids and
        positions, say) reaches each block as ``block(h, context=context)``."""
        graphdef, state = nnx.split(self.layers)
        params = nnx.to_pure_dict(state)

        def layer_fn(layer_params, h, ctx=None, index=None):
            block = nnx.merge(graphdef, layer_params)
            kw = {} if ctx is None else {"context": ctx}
            return block(h, **kw) if index is None else block(h, **kw, layer=index)

        kw = {} if context is None else {"context": context}
        if self.indexed:
            kw["index"] = self.indices()
        if self.runner is not None:
            return self.runner(layer_fn, params, x, **kw)

        def body(h, layer):
            layer_params, index = layer
            return layer_fn(layer_params, h, context, index), None

        if self.remat:
            body = jax.checkpoint(body)
        return lax.scan(body, x, (params, kw.get("index")))[0]

    def indices(self) -> jax.Array:
        """``[0, 1, ..., L-1]`` (int32): what an indexed stack's scan hands its layers."""
        return jnp.arange(self.n_layers, dtype=jnp.int32)

    def decode(self, x: jax.Array, cache: Any, start, *,
               pads: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """Decoding with a cache (inference, no ZeRO): each layer's block is called as
        ``block(h, layer_cache, start) -> (h, layer_cache)``, ``cache`` having a leading
        layer axis.

        ``pads``: int ``[B]``, the padding positions that lead each (left-padded) row of the
        cache, passed on as ``block(..., pads=pads)``; None (no padding) passes nothing, so
        a block without the argument still decodes.
        """
        graphdef, state = nnx.split(self.layers)
        kw = {} if pads is None else {"pads": pads}

        def body(h, layer):
            layer_params, layer_cache, index = layer
            block = nnx.merge(graphdef, layer_params)
            if index is None:
                return block(h, layer_cache, start, **kw)
            return block(h, layer_cache, start, layer=index, **kw)

        index = self.indices() if self.indexed else None
        return lax.scan(body, x, (nnx.to_pure_dict(state), cache, index))


def iter_stacks(model: nnx.Module) -> Iterator[tuple[str, Stack]]:
    """Yield ``(path, stack)`` for every :class:`Stack` in ``model`` (path ``/``-joined)."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Stack):
            yield "/".join(map(str, path)), node


def bind_runners(model: nnx.Module, make_runner: Callable[[str, Stack], Runner | None]) -> None:
    """Give every ``Stack`` in ``model`` the runner ``make_runner(path, stack)``."""
    for path, stack in list(iter_stacks(model)):
        stack.runner = make_runner(path, stack)
