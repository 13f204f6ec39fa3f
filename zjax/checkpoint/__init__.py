"""Checkpoints of a run's state in Orbax: saved and restored through the step's state storage
(``zjax.step.StateStorage``: device, host memory or NVMe swap files alike), the canonical tree
matched by leaf names in either Orbax layout, per-leaf checksums independent of sharding, and
the leaf reader and whole-or-nothing writer that export and ``import-hf`` share.

It owns the ``checkpoint`` section (``zjax.checkpoint.config``, light). It imports
``zjax.step``, ``zjax.offload`` and the bottom layers (errors, schema); names load on first
use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zjax._lazy import exports
from zjax.checkpoint.config import CheckpointConfig

_LAZY = {
    "Checkpointer": "zjax.checkpoint._checkpointer",
    "array_digest": "zjax.checkpoint._digest",
    "check_out": "zjax.checkpoint._leaf_io",
    "item_read": "zjax.checkpoint._leaf_io",
    "from_canonical": "zjax.checkpoint._checkpointer",
    "leaf_name": "zjax.checkpoint._digest",
    "nested": "zjax.checkpoint._leaf_io",
    "read_leaf": "zjax.checkpoint._leaf_io",
    "recorded_digests": "zjax.checkpoint._digest",
    "to_canonical": "zjax.checkpoint._checkpointer",
    "tree_digests": "zjax.checkpoint._digest",
    "write_orbax_leaves": "zjax.checkpoint._leaf_io",
}

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "array_digest",
    "check_out",
    "from_canonical",
    "item_read",
    "leaf_name",
    "nested",
    "read_leaf",
    "recorded_digests",
    "to_canonical",
    "tree_digests",
    "write_orbax_leaves",
]


__getattr__ = exports(__name__, _LAZY)


if TYPE_CHECKING:  # what type checkers and IDEs see
    from zjax.checkpoint._checkpointer import Checkpointer, from_canonical, to_canonical
    from zjax.checkpoint._digest import array_digest, leaf_name, recorded_digests, tree_digests
    from zjax.checkpoint._leaf_io import check_out, item_read, nested, read_leaf, write_orbax_leaves
