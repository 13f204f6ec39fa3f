"""Where a run's state lives, as whoever reads or writes it whole (checkpoints, tests) sees it:
the canonical tree, leaf by leaf.

The canonical tree is ``{"step", "params" (float32 master), "opt_state"}`` with global shapes,
the same whatever the stage, mesh or offload. A :class:`StateStorage` yields its leaves from a
``TrainState`` and builds a ``TrainState`` from leaves read one at a time, so a caller never
asks whether the optimizer state is on the device, in host memory or in NVMe swap files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax

from zjax.offload import to_device
from zjax.step._state import TrainState

__all__ = ["Keys", "MemoryStorage", "Reader", "StateStorage", "path_keys"]

Keys = tuple[str, ...]
Reader = Callable[[Keys, jax.ShapeDtypeStruct], jax.Array]


def path_keys(path) -> Keys:
    """A tree path as string keys whatever its nodes are (dict keys, sequence indices,
    NamedTuple fields): the one naming of canonical leaves (``("params", "blocks", "w")``)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class StateStorage(Protocol):
    """The state of a ``ZeroStep`` as canonical leaves.

    Attributes:
      canonical: the canonical tree, abstract (``ShapeDtypeStruct`` with shardings).
      resident: whether the whole canonical tree may be held in memory at once (device or
        host memory). False when the state lives in swap files: a reader then holds one
        leaf at a time.
    """

    canonical: dict
    resident: bool

    def leaves(self, state: TrainState) -> Iterator[tuple[Keys, jax.Array]]:
        """``(keys, global array)`` of every canonical leaf of ``state``, in tree order, each
        built when asked for."""
        ...

    def restore(self, read: Reader) -> TrainState:
        """The state built from canonical leaves: ``read(keys, target)`` returns the leaf
        ``keys`` laid out as ``target``; each is asked for once, in tree order."""
        ...


def _tree_leaves(tree: Any) -> Iterator[tuple[Keys, Any]]:
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield path_keys(path), x


@dataclasses.dataclass(frozen=True)
class MemoryStorage:
    """State in device or host memory (``zero.offload_*`` to ``cpu`` included): the canonical
    leaves are the master (or the params, without a master), the optax state and the step."""

    canonical: dict
    has_master: bool
    params: Any  # the working params, abstract, with their shardings
    resident: bool = True

    def leaves(self, state: TrainState) -> Iterator[tuple[Keys, jax.Array]]:
        master = state.master if self.has_master else state.params
        yield from _tree_leaves({"step": state.step, "params": master,
                                 "opt_state": state.opt_state})

    def restore(self, read: Reader) -> TrainState:
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.canonical)
        tree = jax.tree.unflatten(treedef, [read(path_keys(p), a) for p, a in flat])
        if not self.has_master:
            return TrainState(tree["step"], tree["params"], None, tree["opt_state"])
        dtypes = jax.tree.map(lambda a: a.dtype, self.params)
        shardings = jax.tree.map(lambda a: a.sharding, self.params)
        # the master may live in host memory (zero.offload_param): cast on the device
        params = jax.jit(lambda m: jax.tree.map(lambda x, d: to_device(x).astype(d), m, dtypes),
                         out_shardings=shardings)(tree["params"])
        return TrainState(tree["step"], params, tree["params"], tree["opt_state"])
