"""Where a run's metrics go: ``metrics.jsonl`` and TensorBoard event files in the run directory."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from zjax.errors import ConfigError

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

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``.

    A last line that is not valid JSON (the process was killed while writing it) is skipped
    with a warning; an invalid line anywhere else means the file is damaged (ConfigError).
    """
    path = Path(run_dir) / "metrics.jsonl"
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                logging.getLogger("zjax").warning(
                    "%s: skipping the torn last line %d (a write was cut short)", path, i)
                break
            raise ConfigError(f"{path}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: line {i} is not a JSON object")
        rows.append(row)
    return rows
