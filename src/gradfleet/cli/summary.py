"""The table ``gradfleet train`` and ``gradfleet compare`` print: the figures of each run, from
rank 0's ``summary.json``, with a legend that says what each run is (the comparison's plot:
:mod:`.plot`).

Runs are numbered in the table and described in full in the legend below it, so a long
``--strategy`` never has to be cut to fit a column; a run that lost workers says so there.
The layout is the widest of three that fits the console without narrowing a column (rich
would cut figures to narrow one): one row per run, else one column per run, else one small
table per run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.measure import Measurement
from rich.segment import Segment
from rich.table import Table

__all__ = ["COLUMNS", "ResultsTable", "columns_markdown", "summary_table"]

_UNBOUNDED = 10_000  # columns: wider than any table's minimum

#: Each figure's heading and what it means (``--help`` and docs/cli.md quote these).
COLUMNS: dict[str, str] = {
    "steps": "model updates made (--steps)",
    "loss": "rank 0's training loss at its last step",
    "test acc": "accuracy of the final model on the test set",
    "steps/s": "steps per second of wall time",
    "step ms": "median time of one of rank 0's steps: forward, backward, communication and "
    "update, waits for other workers included (model-average and easgd: a local step; their "
    "exchanges show in steps/s)",
    "samples/s": "rank 0's training samples per second, times the workers",
    "R": "sync-replicas: gradients per update (chosen per update: their mean and range)",
    "comm MB": "megabytes rank 0 sent to other processes",
    "wall s": "seconds of training, from the common start to rank 0's last step",
}


def columns_markdown() -> str:
    """:data:`COLUMNS` as the Markdown table of docs/cli.md."""
    rows = [f"| `{heading}` | {meaning} |" for heading, meaning in COLUMNS.items()]
    return "\n".join(["| column | what it is |", "|---|---|", *rows]) + "\n"


def _replicas(history: list[int] | None) -> str:
    """Gradients per update (sync-replicas): the R, or the mean and range of chosen ones."""
    if not history:
        return ""
    low, high = min(history), max(history)
    if low == high:
        return str(low)
    return f"{sum(history) / len(history):.1f} ({low}-{high})"


def _figures(r: dict[str, Any]) -> dict[str, str]:
    """``r``'s figures by heading (:data:`COLUMNS`)."""
    figures = [
        str(r["steps"]),
        f"{r['final_loss']:.4f}",
        f"{r['test_accuracy']:.3f}",
        f"{r['steps_per_s']:.1f}",
        f"{r['median_step_ms']:.2f}",
        f"{r['samples_per_s']:.0f}",
        _replicas(r.get("replicas")),
        f"{r['bytes_sent'] / 1e6:.2f}",
        f"{r['wall_s']:.1f}",
    ]
    return dict(zip(COLUMNS, figures, strict=True))


def describe(r: dict[str, Any]) -> str:
    """What run ``r`` was, for the legend: its label, then what the label does not say."""
    args = ",".join(f"{k}={v}" for k, v in r["strategy_args"].items())
    strategy = r["strategy"] + (f":{args}" if args else "")
    k = r.get("servers", 0)
    workers = f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}"
    servers = f" + {k} server{'s' if k > 1 else ''}" if k else ""
    details = [r["optimizer"]["class"], strategy, workers + servers, r["device"]]
    text = f"{r['label']}: " + ", ".join(d for d in details if d not in r["label"].split(" / "))
    lost = r.get("lost_workers") or []  # the figures are those of the workers left
    if lost:
        text += "; lost: " + ", ".join(f"rank {w['rank']} at step {w['step']}" for w in lost)
    back = r.get("rejoined_workers") or []  # restarted into the job
    if back:
        text += "; restarted: " + ", ".join(
            f"rank {w['rank']} (lost at step {w.get('step', '?')}, back at {w['rejoined_at_step']})"
            for w in back
        )
    return text


class ResultsTable:
    """The runs' figures and their legend, laid out for the console's width."""

    def __init__(self, rows: list[dict[str, Any]], title: str) -> None:
        self.rows, self.title = rows, title
        self.figures = [_figures(r) for r in rows]
        # R only where a run has one (sync-replicas)
        self.headings = [h for h in COLUMNS if any(f[h] for f in self.figures)]

    def _row_per_run(self) -> Table:
        table = Table(title=self.title)
        table.add_column("#", justify="right")
        for heading in self.headings:
            table.add_column(heading, justify="right")
        for n, figures in enumerate(self.figures, 1):
            table.add_row(str(n), *(figures[h] for h in self.headings))
        return table

    def _row_per_figure(self, runs: list[int], title: str | None) -> Table:
        """A column for each run of ``runs`` (numbered from 1)."""
        table = Table(title=title)
        table.add_column("#")
        for n in runs:
            table.add_column(str(n), justify="right")
        for heading in self.headings:
            table.add_row(heading, *(self.figures[n - 1][heading] for n in runs))
        return table

    def _legend(self) -> Table:
        legend = Table.grid(padding=(0, 1))
        legend.add_column(justify="right", no_wrap=True)
        legend.add_column(overflow="fold")
        for n, r in enumerate(self.rows, 1):
            legend.add_row(f"{n}", describe(r))
        return legend

    def layouts(self) -> Iterator[Callable[[], RenderableType]]:
        """The layouts, widest first."""
        runs = list(range(1, len(self.rows) + 1))
        yield self._row_per_run
        yield lambda: self._row_per_figure(runs, self.title)
        yield lambda: Group(
            *(self._row_per_figure([n], self.title if n == 1 else None) for n in runs)
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Any]:
        unbounded = options.update_width(_UNBOUNDED)  # rich clamps a measure to the width
        for layout in self.layouts():
            table = layout()
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                break  # no column of this one needs narrowing: every figure stays whole
        yield table
        # the legend's lines end at their text: the grid pads each cell to its column's width
        for line in console.render_lines(self._legend(), options, pad=False):
            yield from _rstripped(line)
            yield Segment.line()


def _rstripped(line: list[Segment]) -> list[Segment]:
    """``line`` without the spaces at its end."""
    line = list(line)
    while line and not line[-1].control and not line[-1].text.rstrip():
        line.pop()
    if line and not line[-1].control:
        text, style, control = line[-1]
        line[-1] = Segment(text.rstrip(), style, control)
    return line


def summary_table(rows: list[dict[str, Any]], title: str) -> ResultsTable:
    """A run per summary: what ran (the legend), how fast, what it reached and sent."""
    return ResultsTable(rows, title)
