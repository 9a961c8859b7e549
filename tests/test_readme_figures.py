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


GPU_DEFAULT = [f"gpu_h200_default/AdamOptimizer{s}.json" for s in
               ("", "-warm", "-cache-first", "-cache-second")]  # fmt: skip

# the start of each row's first cell -> (its figure from the results, their machine)
FIGURES = {
    "fused `AdamOptimizer` step, the CUDA default path": lambda: (
        _span([r["time_vs_torch_fused_adam"] for n in GPU_DEFAULT
               for r in _speed_rows(n, "default")]),  # fmt: skip
        "{gpu}, torch {torch}".format(**_json(GPU_DEFAULT[0])["machine"]),
    ),
    "fused step bandwidth, 16.8M parameters in 41 tensors": lambda: (
        _span([min(r["bw_vs_torch_fused_adam"]
                   for r in _speed_rows("cpu_replayed/default.json", "fused")
                   if r["optimizer"] != "NormalizedSGD")]),  # fmt: skip
        "{cores}-core {cpu}".format(**_json("cpu_replayed/default.json")["machine"]),
    ),
    "SyncReplicas, R = 3 of 4 over the fast hosts, host 3's link at 1/4": lambda: (
        _span(_x_ddp("cluster-withheld-slow.json", "sr-shard-order4-ovs-b")),
        _cluster_machine("cluster-withheld-slow.json"),
    ),
    "SyncReplicas on 4 dedicated server hosts, R = 3 of 4, host 3 computing 2x slower": lambda: (
        _span(_x_ddp("cluster-slow-compute-dt3.json", "sr-ded-order4-ovs-b")
              + _x_ddp("cluster-slow-compute-dt3b.json", "sr-ded-order4-ovs-b")),  # fmt: skip
        _cluster_machine("cluster-slow-compute-dt3.json"),
    ),
    "SyncReplicas on 4 dedicated server hosts, R = 4, even hosts": lambda: (
        _span(_x_ddp("cluster-paced.json", "sr-ded-split-w4")),
        _cluster_machine("cluster-paced.json"),
    ),
    "ModelAverage, interval 8, even hosts": lambda: (
        _span(_x_ddp("cluster-uniform.json", "ma8")),
        _cluster_machine("cluster-uniform.json"),
    ),
}


def _readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    table = text.split("\n## Figures\n", 1)[1].split("\n## ", 1)[0]
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
