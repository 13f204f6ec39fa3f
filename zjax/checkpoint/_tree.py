"""A checkpoint's ``state`` item matched to the canonical tree by leaf names, and written or
read one leaf at a time.

Orbax records the tree it saved: NamedTuples and tuples as lists when the whole tree is saved at
once, as dicts of string keys when it is saved leaf by leaf (Orbax's partial save, used for
state that is not in memory: the NVMe optimizer's). :func:`zjax.checkpoint._digest.leaf_name`
names a leaf the same in both (``opt_state/1/0/mu/w``), so a restore reads either into the
canonical tree: :func:`on_disk` builds the restore target in the layout found on disk,
:func:`canonical` puts the result back, and :func:`leaf_target` selects a single leaf to read.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import v1 as ocp_v1

from zjax.checkpoint._digest import leaf_name, tree_digests
from zjax.checkpoint._leaf_io import item_read, nested

__all__ = ["canonical", "leaf_target", "on_disk", "read_leaf", "write_step"]


def _names(tree: Any) -> list[tuple[str, Any]]:
    return [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout_map(meta_tree: Any, leaf: Callable[[tuple[str, ...]], Any]) -> Any:
    """``meta_tree``'s layout (nested dicts and lists, None for empty nodes) with each leaf
    replaced by ``leaf(its keys)``."""

    def walk(node, prefix):
        if isinstance(node, dict):
            return {k: walk(v, (*prefix, str(k))) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [walk(v, (*prefix, str(i))) for i, v in enumerate(node)]
        return None if node is None else leaf(prefix)

    return walk(meta_tree, ())


def on_disk(meta_tree: Any, abstract: Any) -> Any:
    """``abstract``'s leaves in the on-disk layout ``meta_tree`` (Orbax's metadata tree)."""
    by_name = dict(_names(abstract))
    return _layout_map(meta_tree, lambda keys: by_name["/".join(keys)])


def canonical(restored: Any, abstract: Any) -> Any:
    """A tree restored in an on-disk layout, as ``abstract``'s structure."""
    by_name = dict(_names(restored))
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    return jax.tree.unflatten(treedef, [by_name[leaf_name(p)] for p, _ in paths])


def leaf_target(meta_tree: Any, keys: tuple[str, ...], value: Any) -> Any:
    """A restore item of ``meta_tree``'s layout that holds ``value`` at ``keys`` and Orbax's
    placeholder (not read) at every other leaf."""
    return _layout_map(meta_tree, lambda at: value if at == keys else ocp.PLACEHOLDER)


def read_leaf(state_dir: Path, meta_tree: Any, keys: tuple[str, ...],
              target: jax.ShapeDtypeStruct) -> jax.Array:
    """One leaf of a checkpoint's state, read into ``target``'s sharding (each process reads
    its own shards)."""
    args = ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape,
                                dtype=target.dtype)
    with item_read():
        out = ocp.PyTreeCheckpointer().restore(
            state_dir, args=ocp.args.PyTreeRestore(
                item=leaf_target(meta_tree, keys, 0),
                restore_args=leaf_target(meta_tree, keys, args)))
    for key in keys:
        out = out[int(key)] if isinstance(out, list | tuple) else out[key]
    return out


def write_step(directory: Path, step: int, leaves: Iterable[tuple[tuple[str, ...], Any]],
               items: dict[str, Any]) -> dict[str, str]:
    """Write checkpoint ``step`` under ``directory`` as a CheckpointManager would, its
    ``state`` one leaf at a time (``leaves`` yields ``(keys, array)``, each array built when
    asked for and dropped once written); ``items`` are JSON items. The step directory appears
    whole or not at all. Returns the digests of the leaves (:mod:`zjax.checkpoint._digest`).
    """
    work = directory / f".{step}.zjax-streamed"
    lead = jax.process_index() == 0
    if lead:
        shutil.rmtree(work, ignore_errors=True)  # what an interrupted save left behind
    _barrier(f"zjax-streamed-{step}-start")
    digests: dict[str, str] = {}
    for keys, x in leaves:
        tree = nested([(keys, x)])
        digests.update(tree_digests(tree))
        ocp_v1.partial.save(work / "ckpt", tree)
        del tree, x
    ocp_v1.partial.finalize(work / "ckpt")
    if lead:
        (work / "step").mkdir()
        (work / "ckpt" / "state").rename(work / "step" / "state")
        for name, value in items.items():
            (work / "step" / name).mkdir()
            ocp.JsonCheckpointHandler().save(epath.Path(work / "step" / name),
                                             args=ocp.args.JsonSave(value(digests)
                                                                    if callable(value)
                                                                    else value))
        (work / "step").rename(directory / str(step))
        shutil.rmtree(work, ignore_errors=True)
    _barrier(f"zjax-streamed-{step}-done")
    return digests


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
