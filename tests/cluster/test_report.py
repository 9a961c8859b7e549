"""The cluster benchmark's report: each row's updates/s against DDP's in the same scenario, in
the Markdown table and in the plot's ratio panel, the plot redrawn from a stored result, and
the R of each update and each host's slowdowns where a run recorded them."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from benchmarks.cluster import cluster, cluster_report

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


def _records(ends: dict[int, float], history: list[int] | None, factors: dict) -> list[dict]:
    """What the workers write for a synchronous row trained from update 3 to 11: host h's
    steps at 1 s intervals from t = 100, its last at ``ends[h]``, a loss falling 0.1 a step."""
    records = []
    for h, end in ends.items():
        times = [100.0 + 1 + i for i in range(int(end - 101))] + [end]
        steps = [(t, 2.0 - 0.1 * i, min(3 + i + 1, 11)) for i, t in enumerate(times)]
        record = {"rank": h, "host": h, "compute_s": 0.5, "transfer": {"seconds": 2.0,
                  "updates": 2}, "train_start": 100.0, "steps": steps, "factors": factors[h],
                  "first_update": 3, "last_update": 11}  # fmt: skip
        if history is not None:
            record["replicas_history"] = history
        records.append(record)
    return records


def _summary(row: cluster.Row, records: list[dict]) -> dict:
    hosts = range(len(records))
    samples = [(100.0 + t, {h: (1000 * t, 2000 * t) for h in hosts}, (t, 0, 2 * t + 2))
               for t in range(20)]  # fmt: skip
    args = cluster.parse(["--batch", "8", "--target-loss", "1.5"])
    return cluster_report.summarise(row, records, samples, {h: "200mbit" for h in hosts}, args)


def test_a_row_with_an_r_per_update_reports_it_and_its_samples() -> None:
    rows = {r.key: r for r in cluster.rows(4)}
    history = [4, 4, 4, 3, 3, 2, 4, 3, 3, 2, 2]  # updates 0..10; training: 3..10
    # host 0 was slowed at the end: the job had made its 8 updates when host 2 saw the last
    ends = {0: 112.0, 1: 109.5, 2: 108.0, 3: 110.0}
    factors = {h: [1.0] * 8 for h in range(4)}
    factors[0][-1] = 4.0
    result = _summary(rows["sr-r-auto"], _records(ends, history, factors))
    assert result["updates_s"] == pytest.approx(8 / (108.0 - 100.0))
    trained = history[3:11]
    assert result["samples_s"] == pytest.approx(result["updates_s"] * 8 * sum(trained) / 8)
    assert result["replicas_history"] == history and result["first_update"] == 3
    assert result["slowdown"] == factors
    assert cluster_report.replicas_text(result) == f"{sum(trained) / 8:.2f} (2-4)"
    assert cluster_report.line({**result, "scenario": "transient", "row": {"key": "a"}}).endswith(
        f"R {sum(trained) / 8:.2f} (2-4)"
    )


def test_a_row_without_an_r_per_update_reports_as_before() -> None:
    rows = {r.key: r for r in cluster.rows(4)}
    ends = {h: 110.0 for h in range(4)}
    flat = {h: [1.0] * 9 for h in range(4)}
    fixed = _summary(rows["sr-r3"], _records(ends, None, flat))
    assert fixed["samples_s"] == pytest.approx(fixed["updates_s"] * 3 * 8)
    assert "replicas_history" not in fixed and "slowdown" not in fixed
    assert cluster_report.replicas_text({**fixed, "row": asdict(rows["sr-r3"])}) == "3"
    # "auto" with no history recorded: no samples/s rather than a guess
    auto = _summary(rows["sr-r-auto"], _records(ends, None, flat))
    assert auto["samples_s"] is None
    ddp = _summary(rows["ddp"], _records(ends, None, flat))
    assert ddp["samples_s"] == pytest.approx(ddp["updates_s"] * 4 * 8)
    assert cluster_report.replicas_text({**ddp, "row": asdict(rows["ddp"])}) == "-"
    report = {"machine": "m", "command": "c", "wall_s": 60, "config": vars(cluster.parse([])),
              "scenarios": {"transient": "t"}, "results": [
                  {**r, "scenario": "transient", "row": asdict(rows[k]), "cpu": {"busy": 0.5,
                   "steal": 0.0}} for k, r in (("ddp", ddp), ("sr-r3", fixed),
                                                ("sr-r-auto", auto))]}  # fmt: skip
    table = cluster_report.markdown(report).splitlines()
    assert "Scenario transient: t." in table
    assert table[-3].endswith("| - |") and table[-2].endswith("| 3 |")
    assert table[-1].split("|")[5].strip() == "-"  # auto's samples/s


def test_the_plot_has_a_panel_of_r_per_update_for_each_scenario_with_it() -> None:
    import matplotlib.pyplot as plt

    report = json.loads((RESULTS / "cluster-uniform.json").read_text())
    histories = {"moving-straggler": [4, 4, 3, 2, 3, 4], "transient": [4, 3, 3, 3, 2, 4]}
    added = [
        {**report["results"][0], "scenario": s, "row": {"key": "sr-r-auto", "label": "auto"},
         "replicas_history": h, "first_update": 2} for s, h in histories.items()
    ]  # fmt: skip
    fig = cluster_report.figure({**report, "results": [*report["results"], *added]})
    try:
        assert len(fig.axes) == 5
        for ax, (scenario, history) in zip(fig.axes[3:], histories.items()):
            assert ax.get_title() == f"R per update, {scenario}"
            steps = [line for line in ax.get_lines() if line.get_label() == "sr-r-auto"]
            # update u's R drawn over [u, u + 1]: the last value repeated at the end
            assert [list(line.get_xdata()) for line in steps] == [list(range(len(history) + 1))]
            assert [list(line.get_ydata()) for line in steps] == [[*history, history[-1]]]
            dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
            assert [list(line.get_xdata()) for line in dashed] == [[2, 2]]
    finally:
        plt.close(fig)


@pytest.mark.parametrize("report", _stored_reports(), ids=lambda p: p.stem)
def test_stored_results_still_make_their_table(report: Path) -> None:
    """Results written before the R column and the changing scenarios: the table is made,
    with "-" for R where the row has none."""
    stored = json.loads(report.read_text())
    table = cluster_report.markdown(stored)
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(stored["results"])
