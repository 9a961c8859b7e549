"""The table ``gradfleet train`` and ``gradfleet compare`` print: one row per run, from rank 0's
``summary.json`` (the comparison's plot: :mod:`.plot`)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["summary_table"]


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _replicas(history: list[int] | None) -> str:
    """Gradients per update (sync-replicas): the R, or the mean and range of chosen ones."""
    if not history:
        return ""
    low, high = min(history), max(history)
    if low == high:
        return str(low)
    return f"{sum(history) / len(history):.1f} ({low}-{high})"


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    """A row per run summary: what ran, how fast, what it reached and sent."""
    table = Table(title=title)
    for col in (
        "run",
        "optimizer",
        "strategy",
        "device",
        "workers",
        "steps",
        "final loss",
        "test acc",
        "steps/s",
        "step ms",
        "samples/s",
        "R",
        "comm",
        "wall",
    ):
        table.add_column(
            col, justify="left" if col in ("run", "optimizer", "strategy") else "right"
        )
    for r in rows:
        args = ",".join(f"{k}={v}" for k, v in r["strategy_args"].items())
        k = r.get("servers", 0)
        servers = f" +{k} server{'s' if k > 1 else ''}" if k else ""
        table.add_row(
            r["label"],
            r["optimizer"]["class"],
            r["strategy"] + (f":{args}" if args else "") + servers,
            r["device"],
            str(r["workers"]),
            str(r["steps"]),
            f"{r['final_loss']:.4f}",
            f"{r['test_accuracy']:.3f}",
            f"{r['steps_per_s']:.1f}",
            f"{r['median_step_ms']:.2f}",
            f"{r['samples_per_s']:.0f}",
            _replicas(r.get("replicas")),
            _mb(r["bytes_sent"]),
            f"{r['wall_s']:.1f}s",
        )
    return table
