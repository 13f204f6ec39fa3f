"""``zjax plot RUN_DIR``: loss and throughput curves of a run as PNG files."""

from __future__ import annotations

from pathlib import Path

from zjax._metrics import read_metrics
from zjax.errors import ConfigError

__all__ = ["plot_run"]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``loss.png`` and ``throughput.png`` for the run in ``run_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} has no metrics.jsonl")
    rows = read_metrics(run_dir)
    if not rows:
        raise ConfigError(f"run directory {str(run_dir)!r}: metrics.jsonl is empty")
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "loss.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("tokens_per_s", 0) for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written
