"""``zjax plot RUN_DIR``: loss and throughput curves of a run (and an RL run's reward) as PNG
files."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

from zjax.errors import ConfigError
from zjax.training import read_metrics

__all__ = ["plot_run"]

log = logging.getLogger("zjax")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _has(row, key: str) -> bool:
    """Whether ``row`` is an object with a finite ``step`` and a number (NaN too) at ``key``."""
    return (isinstance(row, dict) and _number(row.get("step")) and math.isfinite(row["step"])
            and _number(row.get(key)))


def _points(rows: list, key: str) -> list[tuple[float, float]]:
    """``(step, row[key])`` of the rows that have both (a NaN loss plots as a gap)."""
    return [(r["step"], r[key]) for r in rows if _has(r, key)]


def _writable_dir(out_dir: Path) -> None:
    """Create ``out_dir`` if needed and check that files can be written in it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".zjax-plot-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--out: cannot write PNGs in {str(out_dir)!r} ({e.strerror or e}); "
                          "expected a writable directory (created if missing)") from None


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``loss.png`` and ``throughput.png`` for the run in ``run_dir`` (and ``reward.png``
    for an RL run); return their paths.

    Rows without a numeric ``loss`` are left out of the train-loss curve, rows without
    ``eval_loss`` out of the eval curve and rows without ``tokens_per_s`` out of the
    throughput plot, which is not written when no row has it.

    Args:
      run_dir: a run directory (it holds ``metrics.jsonl``).
      out_dir: where to write the PNGs (default: ``run_dir``); created if missing.

    Raises:
      ConfigError: no metrics, no row with a loss, or an ``out_dir`` that cannot be written.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} has no metrics.jsonl")
    rows = read_metrics(run_dir)
    if not rows:
        raise ConfigError(f"run directory {str(run_dir)!r}: metrics.jsonl is empty")
    losses, evals = _points(rows, "loss"), _points(rows, "eval_loss")
    if not losses and not evals:
        raise ConfigError(f"{str(metrics)!r}: none of its {len(rows)} rows has a numeric 'step' "
                          "and 'loss' (or 'eval_loss'); nothing to plot")
    skipped = sum(1 for r in rows if not (_has(r, "loss") or _has(r, "eval_loss")))
    if skipped:
        log.warning("plot: %d of %d rows in %s have no numeric step and loss or eval_loss; "
                    "left out", skipped, len(rows), metrics)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    _writable_dir(out_dir)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    if losses:
        ax.plot(*zip(*losses, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out_dir / "loss.png"))

    throughput = _points(rows, "tokens_per_s")
    if not throughput:
        log.warning("plot: no row in %s has tokens_per_s; throughput.png not written", metrics)
        return written
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*throughput, strict=True))
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, out_dir / "throughput.png"))
    return written + _rewards(rows, out_dir, plt)


def _rewards(rows: list, out_dir: Path, plt) -> list[Path]:
    """An RL run's ``reward.png``: the mean reward and each reward function's (none for
    other runs)."""
    reward = _points(rows, "reward")
    if not reward:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*reward, strict=True), label="reward")
    names = sorted({k for r in rows if isinstance(r, dict) for k in r
                    if k.startswith("rewards/")})
    for name in names if len(names) > 1 else []:
        ax.plot(*zip(*_points(rows, name), strict=True), label=name, alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the rollouts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return [_save(fig, out_dir / "reward.png")]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise ConfigError(f"--out: cannot write {str(path)!r} ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return path
