"""Where a run's metrics go: ``metrics.jsonl`` and TensorBoard event files in the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["MetricsWriter", "read_metrics"]


class MetricsWriter:
    """Append one JSON object per logged step; mirror numbers as TensorBoard scalars."""

    def __init__(self, run_dir: Path | None, *, tensorboard: bool = True):
        self.run_dir = run_dir
        self._file = None
        self._tb = None
        if run_dir is None:
            return
        self._file = (run_dir / "metrics.jsonl").open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            step = int(row.get("step", 0))
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
