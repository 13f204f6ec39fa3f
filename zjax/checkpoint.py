"""Orbax checkpoints: async sharded saves, exact resume, restore onto any mesh or stage.

A checkpoint is stage- and mesh-independent: it holds the float32 master params (whatever the
stage stores), the optax state, the step, and (as JSON) the data iterator's state and the run's
config. Restoring takes the *current* step's shardings, so a checkpoint written on 8 devices at
stage 3 restores onto 4 devices, 1 device, or stage 1 (DeepSpeed needs a "universal checkpoint"
conversion for that). Saves are atomic (Orbax writes to a temporary directory and renames it),
asynchronous (training continues while the write completes), and old ones are removed only
after a newer one is complete. A damaged latest checkpoint is moved aside, named in a warning,
and the newest intact one is used instead.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from zjax.errors import CheckpointError, ConfigError
from zjax.offload import to_device
from zjax.step import TrainState, ZeroStep

__all__ = ["CheckpointConfig", "Checkpointer", "from_canonical", "to_canonical"]

log = logging.getLogger("zjax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``checkpoint`` section.

    Attributes:
      every: save every this many steps (0: only at the last step and on preemption).
      keep: how many of the most recent checkpoints to keep.
      asynchronous: write in the background while training continues.
    """

    every: int = 100
    keep: int = 3
    asynchronous: bool = True

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError(f"checkpoint.every: must be >= 0, got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep: must be >= 1, got {self.keep}")


def to_canonical(state: TrainState, zstep: ZeroStep) -> dict:
    """The stage-independent form: float32 master params, optax state, step."""
    master = state.master if zstep.plan.has_master else state.params
    return {"step": state.step, "params": master, "opt_state": state.opt_state}


def _abstract_canonical(zstep: ZeroStep) -> dict:
    a = zstep.abstract_state
    master = a.master if zstep.plan.has_master else a.params
    return {"step": a.step, "params": master, "opt_state": a.opt_state}


def from_canonical(tree: dict, zstep: ZeroStep) -> TrainState:
    """Rebuild the stage's ``TrainState`` (working copy, master) from the canonical form."""
    if not zstep.plan.has_master:
        return TrainState(tree["step"], tree["params"], None, tree["opt_state"])
    dtypes = jax.tree.map(lambda a: a.dtype, zstep.abstract_state.params)
    # the master may live in host memory (zero.offload_param): cast on the device
    params = jax.jit(lambda m: jax.tree.map(lambda x, d: to_device(x).astype(d), m, dtypes),
                     out_shardings=zstep.state_shardings.params)(tree["params"])
    return TrainState(tree["step"], params, tree["params"], tree["opt_state"])


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
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, last: int) -> bool:
        return step == last or (self.config.every > 0 and step % self.config.every == 0)

    def save(self, step: int, state: TrainState, zstep: ZeroStep, *, data_state: Any = None,
             meta: dict | None = None) -> None:
        """Start saving ``state`` at ``step`` (returns before the write completes if async)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(to_canonical(state, zstep)),
            data=ocp.args.JsonSave(data_state if data_state is not None else {}),
            meta=ocp.args.JsonSave(meta or {}),
        )
        self.manager.save(step, args=args, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore(self, step: int, zstep: ZeroStep) -> tuple[TrainState, Any, dict]:
        """Restore ``step`` onto ``zstep``'s mesh and stage: ``(state, data_state, meta)``."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract_canonical(zstep)),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        out = self.manager.restore(step, args=args)
        return from_canonical(out["state"], zstep), out["data"], out["meta"]

    def check_compatible(self, step: int, zstep: ZeroStep) -> None:
        """Raise CheckpointError if the checkpoint's params do not fit the current model."""
        try:
            meta = self.manager.item_metadata(step)["state"]
        except Exception:  # unreadable metadata: left to the damage check
            return
        if meta is None:
            return
        expected = _abstract_canonical(zstep)["params"]
        got = jax.tree_util.tree_flatten_with_path(meta["params"])[0]
        want = jax.tree_util.tree_flatten_with_path(expected)[0]
        got_shapes = {jax.tree_util.keystr(p): tuple(m.shape) for p, m in got}
        want_shapes = {jax.tree_util.keystr(p): tuple(a.shape) for p, a in want}
        if got_shapes != want_shapes:
            diff = sorted(set(got_shapes.items()) ^ set(want_shapes.items()))[:4]
            raise CheckpointError(
                f"checkpoint at step {step} in {self.directory} was written for another model "
                f"(params differ: {diff}); use the model config it was trained with or a new "
                "--run-dir"
            )

    def restore_latest(self, zstep: ZeroStep) -> tuple[int, TrainState, Any, dict] | None:
        """The newest intact checkpoint, moving damaged newer ones aside with a warning."""
        for step in reversed(self.steps()):
            self.check_compatible(step, zstep)
            try:
                state, data_state, meta = self.restore(step, zstep)
                jax.block_until_ready(state)
                return step, state, data_state, meta
            except Exception as e:  # any failure to read means damaged
                aside = self._move_aside(step)
                log.warning(
                    "checkpoint at step %d in %s is damaged (%s: %s); moved it to %s and "
                    "falling back to the previous one", step, self.directory, type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "", aside,
                )
        return None

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
