"""GRPO's training batches, made by rolling out the policy being trained.

Each rollout takes the next ``data.batch_size x rl.steps_per_generation / rl.group_size``
prompts, samples ``rl.group_size`` completions of each from the current state (the step's
rollout program: the shards gathered once, in ``zero.gather_dtype``), scores them with the
reward functions, turns rewards into group advantages, scores the rows' log-probs where the
loss needs them (the rollout policy's, the reference's: once per rollout) and yields
``rl.steps_per_generation`` training batches of ``data.batch_size`` rows.

The draws of rollout ``g`` are keyed by ``fold_in(key(train.seed), g)``, so a resumed run
samples what the run that never stopped sampled. A checkpoint taken between two steps of one
rollout writes that rollout's remaining batches to the run directory
(``rollouts/<step>.<process>.npz``) and reads them back on resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zjax.data import PromptSet, gather_columns, left_padded
from zjax.errors import CheckpointError
from zjax.rl import Rewards, RLConfig, group_advantages, scored_keys
from zjax.step import ZeroStep
from zjax.training._completions import (
    completion_metrics,
    cut_completions,
    texts,
    training_rows,
    write_samples,
)

__all__ = ["RolloutBatches", "local_rows"]


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a global array split over the batch's axes (in order)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])


class RolloutBatches:
    """This process's GRPO batches (numpy dicts), rolled out when the last ones are used.

    Args:
      zstep: the step (its ``rollout`` and ``score`` programs).
      rl: the ``rl`` section.
      prompts: the prompt set; ``indices``: its iterator of this process's prompt indices
        per rollout (:func:`zjax.data.prompt_batches`).
      rewards: the reward functions.
      state_of: the current train state (read when a rollout starts).
      put: a process-local array (or dict) -> the global array.
      decode: ids -> text; ``stop``: the ids that end a completion.
      seq_len: a training row's targets (rows are ``seq_len + 1`` tokens).
      seed: the draws' seed (``train.seed``).
      run_dir: where samples and a checkpoint's pending batches go (None: nowhere).
      log_every: samples are written for rollouts that feed a step logged.
    """

    def __init__(self, zstep: ZeroStep, rl: RLConfig, prompts: PromptSet, indices: Any, *,
                 rewards: Rewards, state_of: Callable[[], Any], put: Callable,
                 decode: Callable[[list[int]], str], stop: tuple[int, ...], seq_len: int,
                 seed: int, run_dir: Path | None, log_every: int):
        self.zstep, self.rl, self.prompts, self.indices = zstep, rl, prompts, indices
        self.rewards, self.state_of, self.put = rewards, state_of, put
        self.decode, self.stop, self.seq_len, self.seed = decode, stop, seq_len, seed
        self.run_dir, self.log_every = run_dir, log_every
        self.stop_ids = jnp.asarray(sorted(stop) or [-1], jnp.int32)
        self.pending: list[dict] = []
        self.generation, self.step, self.metrics = 0, 0, {}
        self.samples: tuple | None = None  # a logged rollout's, until its step has run
        self._last_end: float | None = None

    def __iter__(self) -> RolloutBatches:
        return self

    def __next__(self) -> dict:
        if not self.pending:
            self._rollout()
        self.step += 1
        return self.pending.pop(0)

    def _prompt_rows(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The rollout's prompt ids (each prompt ``group_size`` times in a row) and their
        indices."""
        rows = np.repeat(np.asarray(next(self.indices)), self.rl.group_size)
        return [self.prompts.ids[i] for i in rows], rows

    def _sample(self, state, ids: list[np.ndarray]) -> np.ndarray:
        """``[rows, max_new_tokens]`` ids sampled after each prompt (left-padded to the
        prompts' limit, one compiled shape)."""
        width = self.prompts.prompt_limit
        block, lengths = left_padded(ids, width=width)
        pads = width - lengths
        key = jax.random.fold_in(jax.random.key(self.seed), self.generation)
        rl = self.rl
        out = self.zstep.rollout(state.params, state.frozen, self.put(block), self.put(pads),
                                 key, self.stop_ids, rl.max_new_tokens, float(rl.temperature),
                                 float(rl.top_p))
        return local_rows(out)

    def _rollout(self) -> None:
        rl, state = self.rl, self.state_of()
        jax.block_until_ready(state.params)  # the steps before: their time is training's
        t0 = time.perf_counter()
        train_s = (None if self._last_end is None
                   else (t0 - self._last_end) / rl.steps_per_generation)
        ids, rows = self._prompt_rows()
        done = cut_completions(self._sample(state, ids), self.stop)
        t1 = time.perf_counter()
        prompts, columns = gather_columns(self.prompts, rows)
        completions = texts(done, prompts, self.stop, self.decode)
        rewards, per_function = self.rewards(prompts, completions, columns)
        advantages, group_std = group_advantages(rewards, rl.group_size,
                                                 scale=rl.scale_rewards)
        tokens, mask = training_rows(ids, done, self.seq_len + 1)
        batches = self._split({"tokens": tokens, "loss_mask": mask,
                               "advantages": advantages})
        self._score(state, batches)
        self._last_end = time.perf_counter()
        self.metrics = {**completion_metrics(rewards, group_std, per_function, done),
                        "time_generate_s": t1 - t0, "time_score_s": self._last_end - t1}
        if train_s is not None:
            self.metrics["time_train_s"] = train_s
        if self._logged() and self.run_dir is not None and jax.process_index() == 0:
            self.samples = (self.step + 1, prompts, completions, rewards, advantages)
        self.pending = batches
        self.generation += 1

    def flush_samples(self) -> None:
        """Append the latest logged rollout's samples to ``completions.jsonl`` (called once
        its first step has trained: a run that stops before, at its checks, writes none)."""
        if self.samples is not None:
            write_samples(self.run_dir / "completions.jsonl", *self.samples)
            self.samples = None

    def _split(self, rows: dict) -> list[dict]:
        """The rollout's rows in ``steps_per_generation`` batches (shuffled first when more
        than one, from the seed and the rollout's number, as TRL shuffles them)."""
        n, k = len(rows["tokens"]), self.rl.steps_per_generation
        if k > 1:
            order = np.random.default_rng([self.seed, self.generation]).permutation(n)
            rows = {key: v[order] for key, v in rows.items()}
        return [{key: v[i * n // k:(i + 1) * n // k] for key, v in rows.items()}
                for i in range(k)]

    def _score(self, state, batches: list[dict]) -> None:
        """The log-probs each batch is scored for (once per rollout, by the state that
        sampled it), added to it."""
        if not scored_keys(self.rl):
            return
        for batch in batches:
            out = self.zstep.score(state.params, self.put(batch), state.frozen)
            batch.update({key: local_rows(v) for key, v in out.items()})

    def _logged(self) -> bool:
        first, k = self.step + 1, self.rl.steps_per_generation
        return self.step == 0 or any(s % self.log_every == 0 for s in range(first, first + k))

    def get_state(self) -> dict:
        """Where the rollouts are: the prompt iterator, the rollouts made, the steps fed;
        a rollout's batches not trained yet are written beside the checkpoint."""
        state = {"prompts": self.indices.get_state(), "generation": self.generation,
                 "step": self.step, "metrics": self.metrics, "pending": None,
                 "steps_per_generation": self.rl.steps_per_generation}
        if self.pending:
            if self.run_dir is None:
                raise CheckpointError("a GRPO checkpoint between two steps of a rollout needs "
                                      "a run directory for the rollout's other batches")
            path = self._pending_path(self.step)
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, **{f"{i}/{key}": v for i, batch in enumerate(self.pending)
                              for key, v in batch.items()})
            state["pending"] = path.name
        return state

    def set_state(self, state: dict) -> None:
        self.indices.set_state(state["prompts"])
        self.generation, self.step = int(state["generation"]), int(state["step"])
        self.metrics, self.pending = dict(state.get("metrics") or {}), []
        if not state.get("pending"):
            return
        path = None if self.run_dir is None else self._pending_path(self.step)
        if path is None or not path.is_file():
            raise CheckpointError(f"the checkpoint at step {self.step} continues a rollout "
                                  f"whose batches are not in {path or 'a run directory'}")
        with np.load(path) as f:
            n = 1 + max(int(name.split("/")[0]) for name in f.files)
            self.pending = [{name.split("/")[1]: f[name] for name in f.files
                             if name.split("/")[0] == str(i)} for i in range(n)]
        self._check_pending(path, state.get("steps_per_generation"))

    def _check_pending(self, path: Path, saved_k: int | None) -> None:
        """The saved batches must be this run's: a resume with other settings would fail
        later, deep in the step. The error names the key that differs (``saved_k``: the
        saving run's ``rl.steps_per_generation``; None from a zjax that did not record it)."""
        k, width = self.rl.steps_per_generation, self.seq_len + 1
        got = sorted({b["tokens"].shape[1] for b in self.pending})
        keep = ("; that checkpoint was left as it is: resume with the setting it was saved "
                "with, or train in a new run directory")
        if len(self.pending) >= k:  # fewer: they are trained, then rollouts of k go on
            was = f"{saved_k}" if saved_k is not None else f"more than {len(self.pending)}"
            left = f"{len(self.pending)} batch{'es' if len(self.pending) > 1 else ''}"
            raise CheckpointError(
                f"rl.steps_per_generation: {k}, but the checkpoint at step {self.step} was "
                f"saved with {left} of its rollout still to train (in {path}), by a run with "
                f"rl.steps_per_generation {was}{keep}")
        if got != [width]:
            raise CheckpointError(
                f"data.seq_len: {self.seq_len}, but the checkpoint at step {self.step} left "
                f"{len(self.pending)} batches of a rollout in {path} whose rows are {got} "
                f"tokens wide, not {width} (data.seq_len + 1){keep}")

    def _pending_path(self, step: int) -> Path:
        return Path(self.run_dir) / "rollouts" / f"{step}.{jax.process_index()}.npz"
