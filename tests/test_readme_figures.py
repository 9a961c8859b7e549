"""README.md's table of headline figures: each figure is the one in the benchmark result it
comes from (benchmarks/results/), on the machine that result names, and links to the page
with the rest."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _span(values: list[float]) -> str:
    """A figure as the README writes it: one value, or the lowest and highest of several."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def _speed_rows(name: str, path: str) -> list[dict]:
    return [r for r in _json(name)["rows"] if r["path"] == path]


def _x_ddp(name: str, key: str) -> list[float]:
    """updates/s of row ``key`` over DDP's in the same scenario of the same run."""
    results = [r for r in _json(name)["results"] if "error" not in r]
    out = []
    for r in results:
        if r["row"]["key"] == key:
            (ddp,) = [d for d in results if d["row"]["key"] == "ddp"
                      and d["scenario"] == r["scenario"]]  # fmt: skip
            out.append(r["updates_s"] / ddp["updates_s"])
    return out


def _cluster_machine(name: str) -> str:
    return _json(name)["machine"]


GPU_DEFAULT = [
    f"gpu_h200_default/AdamOptimizer{run}.json"
    for run in ("", "-warm", "-cache-first", "-cache-second")
]


def _gpu_default_adam() -> tuple[str, str]:
    ratios = [r["time_vs_torch_fused_adam"] for n in GPU_DEFAULT for r in _speed_rows(n, "default")]
    return _span(ratios), "{gpu}, torch {torch}".format(**_json(GPU_DEFAULT[0])["machine"])


def _cpu_fused_bandwidth() -> tuple[str, str]:
    name = "cpu_replayed/default.json"
    rows = [r for r in _speed_rows(name, "fused") if r["optimizer"] != "NormalizedSGD"]
    lowest = min(r["bw_vs_torch_fused_adam"] for r in rows)
    return _span([lowest]), "{cores}-core {cpu}".format(**_json(name)["machine"])


def _cluster(key: str, *names: str) -> tuple[str, str]:
    ratios = [ratio for name in names for ratio in _x_ddp(f"{name}.json", key)]
    return _span(ratios), _cluster_machine(f"{names[0]}.json")


# the start of each row's first cell -> (its figure from the results, their machine)
FIGURES = {
    "fused `AdamOptimizer` step, the CUDA default path": _gpu_default_adam,
    "fused step bandwidth, 16.8M parameters in 41 tensors": _cpu_fused_bandwidth,
    "SyncReplicas with default options, R = 4, even hosts": lambda: _cluster(
        "sr-default", "cluster-defaults"
    ),
    "SyncReplicas, R = 3 of 4 over the fast hosts, host 3's link at 1/4": lambda: _cluster(
        "sr-shard-order4-ovs-b", "cluster-withheld-slow"
    ),
    "SyncReplicas on 4 dedicated server hosts, R = 3 of 4, host 3 computing 2x slower": lambda: (
        _cluster("sr-ded-order4-ovs-b", "cluster-slow-compute-dt3", "cluster-slow-compute-dt3b")
    ),
    "SyncReplicas on 4 dedicated server hosts, R = 4, even hosts": lambda: _cluster(
        "sr-ded-auto", "cluster-pacing-per-rank", "cluster-pacing-per-rank-b"
    ),
    "ModelAverage, interval 8, even hosts": lambda: _cluster("ma8", "cluster-uniform"),
}


def _readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    table = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")][2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_every_row_is_checked() -> None:
    rows = _readme_rows()
    assert len(rows) == len(FIGURES)
    assert all(sum(r[0].startswith(k) for k in FIGURES) == 1 for r in rows)


@pytest.mark.parametrize("start", FIGURES)
def test_a_figure_is_its_result(start: str) -> None:
    (row,) = [r for r in _readme_rows() if r[0].startswith(start)]
    _, figure, machine, link = row
    expected, result_machine = FIGURES[start]()
    assert figure.startswith(expected + " "), (figure, expected)
    # the machine the README names is the one the result records
    for word in re.findall(r"H200|AMD EPYC|Intel\(R\) Xeon|\d+-core|torch \S+", result_machine):
        word = word.replace("Intel(R) Xeon", "Intel Xeon")
        if word.startswith("torch") and "emulated" in machine:
            continue  # the cluster rows name the VM; torch's release is on the linked page
        assert word.rstrip(",") in machine, (word, machine)
    page, anchor = re.fullmatch(r"\[[^]]+\]\((docs/[\w-]+\.md)#([\w-]+)\)", link).groups()
    headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), flags=re.M)
    slugs = {re.sub(r"[^\w\s-]", "", h.lower()).strip().replace(" ", "-") for h in headings}
    assert anchor in slugs, (page, anchor)
