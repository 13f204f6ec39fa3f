"""Orbax checkpoints: async sharded saves, exact resume, restore onto any mesh or stage.

A checkpoint is stage- and mesh-independent: it holds the float32 master params (whatever the
stage stores), the optax state, the step, and (as JSON) the data iterator's state and the run's
config. Restoring takes the *current* step's shardings, so a checkpoint written on 8 devices at
stage 3 restores onto 4 devices, 1 device, or stage 1 (DeepSpeed needs a "universal checkpoint"
conversion for that). Saves are atomic (Orbax writes to a temporary directory and renames it),
asynchronous (training continues while the write completes), and old ones are removed only
after a newer one is complete.

Integrity: each checkpoint records a digest of every array (:mod:`zjax.checkpoint._digest`) and
of the data iterator's state; a restore recomputes them. A checkpoint that cannot be read, or
reads back other values than were written, is *damaged*: it is moved aside (never deleted),
named in a warning with the step and the leaf, and the newest intact one is used instead. A
checkpoint that is intact but was written for another model or optimizer is *not* damaged:
restoring it raises a :class:`~zjax.errors.CheckpointError` that says what differs, and nothing
is moved. Any other failure while restoring is a bug, and surfaces as itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from zjax.checkpoint._digest import leaf_name, tree_digests
from zjax.checkpoint._leaf_io import nested
from zjax.checkpoint._tree import canonical, on_disk, read_leaf, write_step
from zjax.checkpoint.config import CheckpointConfig
from zjax.errors import CheckpointError, DamagedCheckpoint, first_line, is_damage
from zjax.step import TrainState, ZeroStep, path_keys

__all__ = ["CheckpointConfig", "Checkpointer", "from_canonical", "to_canonical"]

log = logging.getLogger("zjax")


def to_canonical(state: TrainState, zstep: ZeroStep) -> dict:
    """The stage-independent form: float32 master params, optax state, step.

    Whatever the storage: with the optimizer on NVMe this reads the whole state from the swap
    files into device memory (for tests and small models; checkpoints stream it leaf by
    leaf)."""
    leaves = [x for _, x in zstep.storage.leaves(state)]
    return jax.tree.unflatten(jax.tree.structure(zstep.canonical), leaves)


def from_canonical(tree: dict, zstep: ZeroStep) -> TrainState:
    """Rebuild the stage's ``TrainState`` (working copy, master; or the swap files) from the
    canonical form."""
    leaves = {path_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return zstep.storage.restore(lambda keys, _: leaves[keys])


def _json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _flat_config(config: dict | None, sections=("loop", "model", "optimizer")) -> dict:
    out: dict = {}
    for name in sections:
        value = (config or {}).get(name)
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in value.items()})
        elif value is not None:
            out[name] = value
    return out


def _any_process(flag: bool) -> bool:
    """``flag`` on any process of the job (the same answer everywhere)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def _layout(tree: Any) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {leaf_name(p): (tuple(m.shape), str(np.dtype(m.dtype)) if getattr(m, "dtype", None)
                       is not None else None) for p, m in flat}


class Checkpointer:
    """Saves and restores a run's checkpoints under ``directory``."""

    def __init__(self, directory: str | Path, config: CheckpointConfig):
        self.directory = Path(directory).resolve()
        self.config = config
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {str(directory)!r}: {e}"
            ) from None
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep, create=True,
                enable_async_checkpointing=config.asynchronous,
            ),
        )

    def steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, zstep: ZeroStep, *, data_state: Any = None,
             meta: dict | None = None) -> None:
        """Start saving ``state`` at ``step`` (returns before the write completes if async).

        The digests of every array and of ``data_state`` go into the ``meta`` item.
        """
        data_state = data_state if data_state is not None else {}
        if not zstep.storage.resident:  # not in memory: written leaf by leaf, synchronously
            self._save_streamed(step, state, zstep, data_state, meta)
            return
        canonical = to_canonical(state, zstep)
        meta = {**(meta or {}), "digests": {"state": tree_digests(canonical),
                                            "data": _json_digest(data_state)}}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(canonical),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        self.manager.save(step, args=args, force=True)

    def _save_streamed(self, step: int, state: TrainState, zstep: ZeroStep, data_state: Any,
                       meta: dict | None) -> None:
        """State that is not resident (the NVMe optimizer's), one canonical leaf in memory
        at a time."""
        self.manager.wait_until_finished()
        meta = meta or {}
        items = {"data": data_state, "meta": lambda digests: {
            **meta, "digests": {"state": digests, "data": _json_digest(data_state)}}}
        write_step(self.directory, step,
                   zstep.storage.leaves(state), items)
        self.manager.reload()
        steps = self.steps()
        for old in steps[:max(0, len(steps) - self.config.keep)]:
            self.manager.delete(old)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore(self, step: int, zstep: ZeroStep) -> tuple[TrainState, Any, dict]:
        """Restore ``step`` onto ``zstep``'s mesh and stage: ``(state, data_state, meta)``.

        Raises:
          DamagedCheckpoint: its files cannot be read, or read back other values than the
            digests recorded at save time.
        """
        out = self._read(step, zstep)
        self._verify(step, out)
        if not zstep.storage.resident:
            recorded = ((out["meta"] or {}).get("digests") or {}).get("state")
            return self._read_streamed(step, zstep, recorded), out["data"], out["meta"]
        return from_canonical(out["state"], zstep), out["data"], out["meta"]

    def _read(self, step: int, zstep: ZeroStep) -> dict:
        """The checkpoint's items as stored; DamagedCheckpoint if its files cannot be read.

        State that is not resident (NVMe) is not read here (:meth:`_read_streamed`)."""
        items = {"data": ocp.args.JsonRestore(), "meta": ocp.args.JsonRestore()}
        try:
            resident = zstep.storage.resident
            if resident:  # in the layout found on disk (see zjax.checkpoint._tree)
                target = on_disk(self._meta_tree(step), zstep.canonical)
                items["state"] = ocp.args.StandardRestore(target)
            out = dict(self.manager.restore(step, args=ocp.args.Composite(**items)))
            if resident:
                out["state"] = canonical(out["state"], zstep.canonical)
            return out
        except Exception as e:
            if not is_damage(e):
                raise
            raise DamagedCheckpoint(f"step {step}: it cannot be read ({type(e).__name__}: "
                                    f"{first_line(e)})") from e

    def _meta_tree(self, step: int) -> Any:
        return self.manager.item_metadata(step)["state"].tree

    def _read_streamed(self, step: int, zstep: ZeroStep, recorded: dict | None) -> TrainState:
        """Restore ``step`` through the step's storage (fresh NVMe swap files), one leaf at a
        time, each checked against its recorded digest."""
        state_dir = self.directory / str(step) / "state"
        meta_tree = self._meta_tree(step)

        def read(keys, target):
            try:
                x = read_leaf(state_dir, meta_tree, keys, target)
            except Exception as e:
                if not is_damage(e):
                    raise
                raise DamagedCheckpoint(f"step {step}: leaf {'/'.join(keys)} cannot be read "
                                        f"({type(e).__name__}: {first_line(e)})") from e
            name = "/".join(keys)
            if (recorded is not None and name in recorded
                    and tree_digests(nested([(keys, x)]))[name] != recorded[name]):
                raise DamagedCheckpoint(f"step {step}: leaf {name} reads back other values "
                                        "than were written (checksum mismatch)")
            return x

        return zstep.storage.restore(read)

    def _verify(self, step: int, out: dict) -> None:
        """Compare what was read with the digests recorded at save time (collective)."""
        recorded = (out["meta"] or {}).get("digests")
        if recorded is None:  # written before zjax recorded digests: nothing to compare
            return
        if _json_digest(out["data"]) != recorded.get("data"):
            raise DamagedCheckpoint(f"step {step}: the data iterator's state reads back altered")
        if "state" not in out:  # read leaf by leaf, and checked as it was (NVMe)
            return
        digests = tree_digests(out["state"])
        unknown = sorted(set(digests) - set(recorded.get("state") or {}))
        if unknown:  # named another way when it was saved: it cannot be checked, not damage
            log.warning("checkpoint at step %d: no recorded checksum for %d arrays (e.g. %s); "
                        "they are not verified", step, len(unknown), unknown[0])
        for key, digest in digests.items():
            if key not in unknown and recorded["state"][key] != digest:
                raise DamagedCheckpoint(f"step {step}: leaf {key} reads back other values than "
                                        "were written (checksum mismatch)")

    def check_compatible(self, step: int, zstep: ZeroStep, *, config: dict | None = None
                         ) -> None:
        """Raise CheckpointError if checkpoint ``step`` holds another model or optimizer's state.

        Args:
          step: the checkpoint.
          zstep: the current step (its canonical state is what must match).
          config: the current run's config as a dict, to name the settings that differ.

        Raises:
          DamagedCheckpoint: the checkpoint's metadata cannot be read.
          CheckpointError: the arrays differ in names, shapes or dtypes.
        """
        try:
            meta = self.manager.item_metadata(step)["state"]
        except Exception as e:  # unreadable metadata is damage; anything else surfaces (a
            # filesystem error or a bug must not move an intact checkpoint aside)
            if not is_damage(e):
                raise
            raise DamagedCheckpoint(f"step {step}: its metadata cannot be read "
                                    f"({type(e).__name__}: {str(e)[:200]})") from None
        if meta is None:
            raise DamagedCheckpoint(f"step {step}: it has no state metadata")
        got, want = _layout(meta), _layout(zstep.canonical)
        if got == want:
            return
        settings = self._config_diff(step, config)
        only_ckpt = sorted(set(got) - set(want))
        only_run = sorted(set(want) - set(got))
        changed = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        parts = []
        if only_ckpt:
            parts.append(f"{len(only_ckpt)} arrays only in the checkpoint (e.g. {only_ckpt[0]})")
        if only_run:
            parts.append(f"{len(only_run)} only in this run (e.g. {only_run[0]})")
        if changed:
            k = changed[0]
            parts.append(f"{len(changed)} of another shape or dtype (e.g. {k}: "
                         f"{got[k]} -> {want[k]})")
        raise CheckpointError(
            f"the checkpoint at step {step} in {self.directory} holds the state of another "
            f"model or optimizer{': ' + settings if settings else ''} ({'; '.join(parts)}). "
            "Nothing was changed: train with the config it was written with, or use a new "
            "--run-dir"
        )

    def _config_diff(self, step: int, config: dict | None) -> str:
        if config is None:
            return ""
        try:
            old = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"].get("config")
        except Exception:  # only used to word the message
            return ""
        a, b = _flat_config(old), _flat_config(config)
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6])

    def restore_latest(self, zstep: ZeroStep, *, config: dict | None = None
                       ) -> tuple[int, TrainState, Any, dict] | None:
        """The newest intact checkpoint, moving damaged newer ones aside with a warning.

        With several processes, each reads its own shards: they agree that a checkpoint is
        damaged (any process failing to read it) before the collective checksum, so all move
        on to the same older one.

        Args:
          zstep: the step to restore onto.
          config: the current run's config as a dict (names the settings that differ when a
            checkpoint holds another model's or optimizer's state).

        Raises:
          CheckpointError: an intact checkpoint was written for another model or optimizer.
        """
        for step in reversed(self.steps()):
            damage, out = None, None
            try:
                self.check_compatible(step, zstep, config=config)
                out = self._read(step, zstep)
            except DamagedCheckpoint as e:
                damage = e
            if _any_process(damage is not None):
                self._set_aside(step, damage or "another process could not read it")
                continue
            try:
                self._verify(step, out)  # the same answer on every process
                if not zstep.storage.resident:
                    recorded = ((out["meta"] or {}).get("digests") or {}).get("state")
                    state = self._read_streamed(step, zstep, recorded)
            except DamagedCheckpoint as e:
                damage = e
            if _any_process(damage is not None):
                self._set_aside(step, damage or "another process could not read it")
                continue
            if not zstep.storage.resident:
                return step, state, out["data"], out["meta"]
            state = from_canonical(out["state"], zstep)
            jax.block_until_ready(state)
            return step, state, out["data"], out["meta"]
        return None

    def _set_aside(self, step: int, why: Exception | str) -> None:
        aside = self._move_aside(step)
        log.warning("checkpoint at step %d in %s is damaged (%s); moved it to %s and falling "
                    "back to the previous one", step, self.directory,
                    f"{type(why).__name__}: {first_line(why)}" if isinstance(why, Exception)
                    else why, aside)

    def _move_aside(self, step: int) -> Path:
        src = self.directory / str(step)
        dst = self.directory.parent / f"damaged-checkpoint-{step}"
        n = 1
        while dst.exists():
            dst = self.directory.parent / f"damaged-checkpoint-{step}.{n}"
            n += 1
        if jax.process_index() == 0:  # one mover; the others wait for it
            shutil.move(str(src), str(dst))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"zjax-damaged-checkpoint-{step}")
        self.manager.reload()
        return dst
