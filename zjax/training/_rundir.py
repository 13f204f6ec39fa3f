"""The run directory: one trainer at a time, nothing overwritten, files replaced atomically.

A run directory holds ``config.yaml``, ``metrics.jsonl``, TensorBoard events and
``checkpoints/``. :class:`RunDir` takes an exclusive lock on it for the whole run (``flock`` on
``.lock``: the kernel releases it when the process ends in any way, so a dead trainer never
leaves a stale lock; across hosts it needs a filesystem whose locks span them, as NFSv4 and
Lustre with flock do), refuses a directory that holds metrics but nothing to resume from, and
writes ``config.yaml`` only when asked, after the resume checks have passed.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

import yaml

from zjax.errors import ConfigError
from zjax.training._metrics import read_metrics

__all__ = ["RunDir", "atomic_write"]


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    """An exclusively locked run directory (process 0 of a job holds it).

    Args:
      path: the directory; created if missing.

    Raises:
      ConfigError: the directory cannot be created or written, another trainer holds it, or it
        holds a run's metrics but no checkpoint to resume from.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = (self.path / ".lock").open("a+")
        except OSError as e:
            raise ConfigError(f"--run-dir: cannot write to {str(self.path)!r}: {e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not isinstance(e, BlockingIOError):  # ENOLCK, EOPNOTSUPP: no locks there
                self._lock.close()
                raise ConfigError(
                    f"--run-dir: {str(self.path)!r} cannot be locked ({e.strerror or e}): this "
                    "filesystem offers no file locks (NFS mounted with nolock, some Lustre "
                    "setups); use a directory on one that does") from None
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise ConfigError(
                f"--run-dir: {str(self.path)!r} is in use by another trainer ({holder}); wait "
                "for it to finish or choose another directory") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock.flush()
        ckpts = self.path / "checkpoints"
        has_checkpoints = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
        if (self.path / "metrics.jsonl").exists() and not has_checkpoints:
            self.close()
            raise ConfigError(
                f"--run-dir: {str(self.path)!r} already holds a run (metrics.jsonl) but no "
                "checkpoint to resume from; zjax does not overwrite it. Choose a new directory."
            )

    def write_config(self, config: dict) -> None:
        """Write ``config.yaml`` (atomically: a reader sees the old file or the new one)."""
        try:
            atomic_write(self.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        except OSError as e:
            raise ConfigError(f"--run-dir: cannot write to {str(self.path)!r}: {e}") from None

    def write_plan(self, report: dict) -> None:
        """Write ``plan.json``: the compiled step's :class:`~zjax.planning.PlanReport`."""
        try:
            atomic_write(self.path / "plan.json", json.dumps(report, indent=1) + "\n")
        except OSError as e:
            raise ConfigError(f"--run-dir: cannot write to {str(self.path)!r}: {e}") from None

    def truncate_metrics(self, step: int) -> None:
        """Drop rows logged after ``step`` (a resume logs them again; 0: all) and any torn
        last line.

        Raises:
          ConfigError: ``metrics.jsonl`` is damaged before its last line.
        """
        if (self.path / "metrics.jsonl").exists():
            rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
            atomic_write(self.path / "metrics.jsonl",
                          "".join(json.dumps(r) + "\n" for r in rows))

    def close(self) -> None:
        """Release the lock."""
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
