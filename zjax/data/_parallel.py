"""Encoding rows in worker processes (``zjax tokenize --workers``): the chat template renders
in Python, so one process renders one conversation at a time whatever the cores.

Groups of rows go to ``workers`` spawned processes, each with its own :class:`Encoder` of the
same ``data`` section (and a single-threaded tokenizer: the processes are the parallelism);
results come back in the rows' order, at most ``2 * workers`` groups in flight. The encoding
of a group is the same function as in one process, so the output is the same bytes (and a
``preference`` source's cuts and skips, counted in the workers, are added up here).

The workers ignore SIGINT and end with this process (:func:`zjax.runtime.stop.worker_start`);
when the encoding stops early (an error, an interrupt, the consumer closing the generator) the
workers are terminated at once, not waited for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import os
from collections.abc import Iterable, Iterator

import numpy as np

from zjax.data._documents import Encoder, groups
from zjax.data._preference import PreferenceStats
from zjax.data.config import DataConfig

__all__ = ["encode_in_parallel"]

_ENCODER: Encoder | None = None


def _start(data: DataConfig) -> None:
    global _ENCODER
    from zjax.runtime.stop import worker_start

    worker_start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # this worker is one of the cores
    logging.getLogger("zjax").setLevel(logging.ERROR)  # the parent's Encoder said it already
    _ENCODER = Encoder(data)


def _encode(group: list[tuple[str, dict]]):
    """The group's documents, and what was cut and skipped of it (``preference``)."""
    _ENCODER.reset()
    return list(_ENCODER.encode_group(group)), _ENCODER.stats


def encode_in_parallel(data: DataConfig, rows: Iterable[tuple[str, dict]], *, workers: int,
                       stats: PreferenceStats | None = None
                       ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``Encoder(data).documents(rows)``, encoded by ``workers`` processes; ``stats`` (a
    ``preference`` encoder's) counts what they cut and skipped."""
    context = multiprocessing.get_context("spawn")  # no fork of a threaded tokenizer
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                  initializer=_start, initargs=(data,))
    try:
        pending: collections.deque = collections.deque()
        for group in groups(rows):
            pending.append(pool.submit(_encode, group))
            if len(pending) >= 2 * workers:
                yield from _done(pending.popleft(), stats)
        while pending:
            yield from _done(pending.popleft(), stats)
    except BaseException:
        _terminate(pool)
        raise
    pool.shutdown(wait=True)


def _done(future: concurrent.futures.Future, stats: PreferenceStats | None):
    docs, counted = future.result()
    if stats is not None and counted is not None:
        stats.add(counted)
    return docs


def _terminate(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """End ``pool``'s processes now (their groups in flight are dropped)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # shutdown forgets it
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        p.terminate()
    for p in processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    # The pool's manager thread closes its wake-up pipe as it ends; CPython 3.11's exit hook
    # for pools writes to that pipe unlocked, so a thread still ending at exit printed an
    # "Exception ignored ... Bad file descriptor" traceback after "stopped by SIGTERM".
    if manager is not None:
        manager.join(timeout=10)
