"""The results table of ``gradfleet train`` / ``compare`` at the widths a terminal has: every
run told apart (numbered, and named whole in the legend), every figure whole."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from gradfleet.cli.summary import COLUMNS, summary_table


def _run(label: str, strategy: str, args: dict, **figures) -> dict:
    """A run's summary, as rank 0 writes ``summary.json``."""
    return {
        "label": label,
        "optimizer": {"class": "adam"},
        "strategy": strategy,
        "strategy_args": args,
        "workers": 4,
        "servers": 0,
        "device": "cpu",
        "steps": 300,
        "final_loss": 0.063912,
        "test_accuracy": 0.9461,
        "steps_per_s": 37.14,
        "median_step_ms": 25.444,
        "samples_per_s": 4745.2,
        "replicas": None,
        "bytes_sent": 11_530_000,
        "wall_s": 8.08,
        **figures,
    }


# gradfleet compare -s sync-replicas:replicas_to_aggregate=auto -s ...=2 -s ...: labels that
# differ only at their ends, and an R chosen per update
RUNS = [
    _run(
        "sync-replicas:replicas_to_aggregate=auto",
        "sync-replicas",
        {"replicas_to_aggregate": "auto"},
        replicas=[4, 4, 2, 3, 3],
        steps_per_s=161.27,
        final_loss=0.39124,
        samples_per_s=123456.7,
    ),
    _run(
        "sync-replicas:replicas_to_aggregate=2",
        "sync-replicas",
        {"replicas_to_aggregate": 2},
        replicas=[2] * 5,
        median_step_ms=0.823,
        bytes_sent=1_420_000,
    ),
    _run(
        "sync-replicas:replicas_to_aggregate=4,transport=server",
        "sync-replicas",
        {"replicas_to_aggregate": 4, "transport": "server"},
        replicas=[4] * 5,
        wall_s=63.04,
    ),
    _run("allreduce", "allreduce", {}, test_accuracy=0.9, steps=1200),
]


def _expected(r: dict) -> dict[str, str]:
    """Each figure as the table must show it."""
    history = r["replicas"]
    if history is None:
        replicas = ""
    elif len(set(history)) == 1:
        replicas = str(history[0])
    else:
        replicas = f"{sum(history) / len(history):.1f} ({min(history)}-{max(history)})"
    return {
        "steps": str(r["steps"]),
        "loss": f"{r['final_loss']:.4f}",
        "test acc": f"{r['test_accuracy']:.3f}",
        "steps/s": f"{r['steps_per_s']:.1f}",
        "step ms": f"{r['median_step_ms']:.2f}",
        "samples/s": f"{r['samples_per_s']:.0f}",
        "R": replicas,
        "comm MB": f"{r['bytes_sent'] / 1e6:.2f}",
        "wall s": f"{r['wall_s']:.1f}",
    }


def _render(rows: list[dict], width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(summary_table(rows, "gradfleet compare: digits, 4 workers"))
    return console.export_text()


def _cells(text: str) -> dict[tuple[str, int], str]:
    """(heading, run number) -> the cell, read from whichever layout was drawn: a row per run
    (headings across), or a row per figure (run numbers across), once or per run."""
    cells: dict[tuple[str, int], str] = {}
    across: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("┃"):
            across = [c.strip() for c in line.strip("┃").split("┃")]
        elif line.startswith("│"):
            first, *rest = (c.strip() for c in line.strip("│").split("│"))
            for head, cell in zip(across[1:], rest, strict=True):
                key = (head, int(first)) if first.isdigit() else (first, int(head))
                assert key not in cells, key
                cells[key] = cell
    return cells


@pytest.mark.parametrize("width", [80, 100, 160, 40])
def test_every_run_and_figure_whole_at_any_width(width: int) -> None:
    text = _render(RUNS, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text
    cells = _cells(text)
    for n, run in enumerate(RUNS, 1):
        for heading, figure in _expected(run).items():
            assert cells[(heading, n)] == figure, (width, heading, n)
        # the legend names the run whole by the number the table uses: on one line of its
        # own where the width allows, folded over several where it does not
        entry = f"{n} {run['label']}: adam, 4 workers, cpu"
        if len(entry) <= width:
            assert entry in [line.strip() for line in lines]
        else:
            assert "".join(entry.split()) in "".join(text.split())
    assert {h for h, _ in cells} == set(COLUMNS)
    # the legend (below the table's last border) pads no line with spaces
    legend = lines[max(i for i, line in enumerate(lines) if line.startswith("└")) + 1 :]
    assert legend and all(line == line.rstrip() for line in legend), legend


def test_wide_terminal_shows_one_row_per_run() -> None:
    header = next(line for line in _render(RUNS, 160).splitlines() if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")] == ["#", *COLUMNS]


def test_r_column_only_when_a_run_has_one() -> None:
    cells = _cells(_render(RUNS[3:], 80))
    assert "R" not in {h for h, _ in cells}
    assert cells[("steps", 1)] == "1200"


def test_legend_names_what_the_label_does_not() -> None:
    """``train`` labels a run by its directory; ``compare -o`` by optimizer / strategy."""
    train = {**RUNS[1], "label": "20260101-120000-digits-adam-sync-replicas", "servers": 2}
    mixed = {**RUNS[3], "label": "adam / allreduce", "workers": 1, "device": "cuda"}
    text = " ".join(_render([train, mixed], 160).split())
    assert (
        "1 20260101-120000-digits-adam-sync-replicas: adam, "
        "sync-replicas:replicas_to_aggregate=2, 4 workers + 2 servers, cpu"
    ) in text
    assert "2 adam / allreduce: 1 worker, cuda" in text


def test_the_legend_names_the_workers_a_run_lost() -> None:
    lost = _run(
        "sync-replicas:replicas_to_aggregate=3,max_losses=1",
        "sync-replicas",
        {"replicas_to_aggregate": 3, "max_losses": 1},
        lost_workers=[{"rank": 2, "step": 61, "cause": "killed by signal 9", "log": "x"}],
    )
    buffer = io.StringIO()
    Console(file=buffer, width=100).print(summary_table([lost, RUNS[1]], "t"))
    said = [line.rstrip() for line in buffer.getvalue().splitlines() if "lost:" in line]
    assert len(said) == 1 and "max_losses=1" in said[0], said  # that run only
    assert said[0].endswith("; lost: rank 2 at step 61"), said


def test_the_legend_names_the_workers_restarted_into_a_run() -> None:
    back = _run(
        "sync-replicas:replicas_to_aggregate=2",
        "sync-replicas",
        {"replicas_to_aggregate": 2},
        rejoined_workers=[
            {"rank": 0, "step": 43, "cause": "killed by signal 9", "rejoined_at_step": 45},
            {"rank": 0, "step": 90, "cause": "killed by signal 9", "rejoined_at_step": 93},
        ],
    )
    buffer = io.StringIO()
    Console(file=buffer, width=200).print(summary_table([back], "t"))
    said = [line.rstrip() for line in buffer.getvalue().splitlines() if "restarted:" in line]
    assert len(said) == 1, buffer.getvalue()
    assert said[0].endswith(
        "; restarted: rank 0 (lost at step 43, back at 45), rank 0 (lost at step 90, back at 93)"
    ), said
