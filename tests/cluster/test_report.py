"""The cluster benchmark's report: each row's updates/s against DDP's in the same scenario, in
the Markdown table and in the plot's ratio panel, and the plot redrawn from a stored result."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from benchmarks import cluster, cluster_report

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _row(scenario: str, key: str, updates_s: float | None) -> dict:
    if updates_s is None:
        return {"scenario": scenario, "row": {"key": key, "label": key}, "error": "exit 1"}
    return {"scenario": scenario, "row": {"key": key, "label": key}, "updates_s": updates_s}


def test_ratios_are_against_ddp_of_the_same_scenario() -> None:
    results = [
        _row("uniform", "ddp", 0.4),
        _row("uniform", "sr-shard", 0.3),
        _row("uniform", "easgd", None),  # failed: no ratio
        _row("slow-link", "sr-shard", 0.25),
        _row("slow-link", "ddp", 0.1),  # DDP after the row: still its scenario's anchor
        _row("slow-compute", "ddp", None),  # the anchor failed: no ratios in that scenario
        _row("slow-compute", "ma8", 0.2),
        _row("other", "ma8", 0.5),  # no DDP row at all
    ]
    assert cluster_report.ratios_to_ddp(results) == {
        ("uniform", "ddp"): 1.0,
        ("uniform", "sr-shard"): 0.3 / 0.4,
        ("slow-link", "sr-shard"): 0.25 / 0.1,
        ("slow-link", "ddp"): 1.0,
    }


def _stored_reports() -> list[Path]:
    return sorted(p for p in RESULTS.glob("cluster*.json") if p.with_suffix(".md").exists())


@pytest.mark.parametrize("report", _stored_reports(), ids=lambda p: p.stem)
def test_ratios_match_the_stored_tables(report: Path) -> None:
    """The "x DDP" column each run wrote when it ran (the table's own code then) is the ratio
    recomputed from the run's JSON, to the table's two decimals."""
    results = json.loads(report.read_text())["results"]
    ratios = cluster_report.ratios_to_ddp(results)
    rows = [r for r in results if "error" not in r]
    lines = [
        line
        for line in report.with_suffix(".md").read_text().splitlines()
        if line.startswith("| ") and "failed:" not in line and not line.startswith("| scenario")
    ]
    assert len(lines) == len(rows)
    for result, line in zip(rows, lines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == result["scenario"] and float(cells[2]) == round(result["updates_s"], 3)
        ratio = ratios.get((result["scenario"], result["row"]["key"]))
        assert cells[3] == ("-" if ratio is None else f"{ratio:.2f}"), line


def test_the_plot_has_a_ratio_panel_with_a_line_at_one(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    report = json.loads((RESULTS / "cluster-uniform.json").read_text())
    ratios = cluster_report.ratios_to_ddp(report["results"])
    fig = cluster_report.figure(report)
    try:
        raw, against_ddp, _links = fig.axes
        keys = [t.get_text() for t in against_ddp.get_xticklabels()]
        heights = [bar.get_height() for bar in against_ddp.patches]
        assert heights == [ratios["uniform", k] for k in keys]
        assert [bar.get_height() for bar in raw.patches] == [
            next(r["updates_s"] for r in report["results"] if r["row"]["key"] == k) for k in keys
        ]
        assert raw.get_yscale() == "log" and against_ddp.get_yscale() == "linear"
        assert any(set(line.get_ydata()) == {1.0} for line in against_ddp.get_lines())
    finally:
        plt.close(fig)


def test_replot_redraws_the_png_from_the_json(tmp_path: Path) -> None:
    shutil.copy(RESULTS / "cluster-slow-link.json", tmp_path / "run.json")
    assert cluster.main(["--replot", str(tmp_path / "run.json")]) == 0
    png = (tmp_path / "run.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 3 * height  # three panels side by side
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.png"]


def test_the_documented_replot_command_names_real_results() -> None:
    """docs/cluster.md's redraw command names results that exist."""
    page = (RESULTS.parents[1] / "docs" / "cluster.md").read_text()
    command = next(line for line in page.splitlines() if "--replot" in line)
    named = re.findall(r"benchmarks/results/[\w*.-]+\.json", command)
    assert named and all(list(RESULTS.parent.parent.glob(p)) for p in named)
