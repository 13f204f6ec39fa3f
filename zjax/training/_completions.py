"""A rollout's completions as the reward functions and the GRPO step see them: ids cut at
their stop token, text (or TRL's conversational form), the rows trained on, the rollout's
metrics (TRL's names) and the samples written to the run directory."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Completions", "completion_metrics", "cut_completions", "texts", "training_rows",
           "write_samples"]


class Completions:
    """Sampled rows cut at their first stop id (kept: TRL's completion mask counts it).

    Attributes:
      ids: per row, its completion's int32 ids (the stop id included where one was drawn).
      lengths: int ``[rows]``, the ids' counts.
      clipped: bool ``[rows]``, the row drew no stop id within the new tokens.
    """

    def __init__(self, ids: list[np.ndarray], lengths: np.ndarray, clipped: np.ndarray):
        self.ids, self.lengths, self.clipped = ids, lengths, clipped


def cut_completions(tokens: np.ndarray, stop: Sequence[int]) -> Completions:
    """``tokens`` ``[rows, new]`` (``-1`` after a row stopped) as :class:`Completions`."""
    stops = np.isin(tokens, np.asarray(list(stop) or [-2]))
    has = stops.any(axis=1)
    first = np.where(has, stops.argmax(axis=1) + 1, tokens.shape[1])
    ids = [row[:n].astype(np.int32) for row, n in zip(tokens, first, strict=True)]
    return Completions(ids, first.astype(np.int32), ~has)


def texts(done: Completions, prompts: list, stop: Sequence[int],
          decode: Callable[[list[int]], str]) -> list:
    """Each completion as its reward functions receive it (TRL's): text without the stop
    token, or ``[{"role": "assistant", "content": text}]`` where its prompt is messages."""
    out = []
    for ids, prompt in zip(done.ids, prompts, strict=True):
        body = [int(i) for i in ids if int(i) not in stop]
        text = decode(body)
        out.append([{"role": "assistant", "content": text}] if isinstance(prompt, list)
                   else text)
    return out


def training_rows(prompt_ids: Sequence[np.ndarray], done: Completions, width: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, loss_mask)`` int32 ``[rows, width]``: each prompt followed by its
    completion, padded with 0 on the right; the mask 1 on the completion's ids."""
    tokens = np.zeros((len(done.ids), width), np.int32)
    mask = np.zeros_like(tokens)
    for row, (prompt, ids) in enumerate(zip(prompt_ids, done.ids, strict=True)):
        p, n = len(prompt), len(ids)
        tokens[row, :p], tokens[row, p:p + n] = prompt, ids
        mask[row, p:p + n] = 1
    return tokens, mask


def completion_metrics(rewards: np.ndarray, group_std: np.ndarray, per_function: dict,
                       done: Completions) -> dict[str, float]:
    """TRL's rollout metrics: ``reward`` (mean), ``reward_std`` (the groups' standard
    deviation, averaged), ``rewards/<function>``, ``completions/mean_length``,
    ``completions/clipped_ratio`` (rows that hit ``rl.max_new_tokens``)."""
    return {"reward": float(np.mean(rewards)), "reward_std": float(np.mean(group_std)),
            **per_function, "completions/mean_length": float(np.mean(done.lengths)),
            "completions/clipped_ratio": float(np.mean(done.clipped))}


def write_samples(path: Path, step: int, prompts: list, completions: list,
                  rewards: np.ndarray, advantages: np.ndarray, *, n: int = 4) -> None:
    """Append ``n`` of a rollout's completions, with their rewards and advantages, to
    ``path`` (JSON lines: ``step``, ``prompt``, ``completion``, ``reward``, ``advantage``)."""
    with open(path, "a", encoding="utf-8") as f:
        for i in range(min(n, len(completions))):
            row: dict[str, Any] = {"step": step, "prompt": prompts[i],
                                   "completion": completions[i],
                                   "reward": float(rewards[i]),
                                   "advantage": float(advantages[i])}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
