"""The comparison plot: training loss against wall time and against steps, one line per run."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_metrics", "plot_runs"]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average: per-batch loss is too noisy to compare."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot_runs(runs: dict[str, Path], out: Path, title: str) -> None:
    """Write a PNG of every run's (smoothed) training loss, keyed by its label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_step) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    for label, metrics_path in runs.items():
        recs = [r for r in read_metrics(metrics_path) if "loss" in r]
        if not recs:
            continue
        loss = _smooth([r["loss"] for r in recs])
        (line,) = ax_time.plot([r["wall"] for r in recs], loss, label=label, linewidth=1.8)
        ax_step.plot(
            [r["step"] for r in recs], loss, label=label, linewidth=1.8, color=line.get_color()
        )
    for ax, xlabel in ((ax_time, "wall time (s)"), (ax_step, "step")):
        ax.set_xlabel(xlabel, fontsize=12)
        ax.set_ylabel("training loss (EMA 0.9, rank 0)", fontsize=12)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=10)
    ax_time.set_title("loss vs wall time", fontsize=13)
    ax_step.set_title("loss vs steps", fontsize=13)
    fig.suptitle(title, fontsize=14)
    fig.savefig(out, dpi=110)
    plt.close(fig)
