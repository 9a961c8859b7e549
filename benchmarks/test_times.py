"""Each test's wall time in a pytest run, and what a set of markers would cost: the figures
behind the suite's stages (docs/testing.md, benchmarks/results/suite-time.md).

Record, from the repository root (the plugin runs in each xdist worker; each appends one
JSON line per test to the file)::

    GRADFLEET_TEST_TIMES=/tmp/times.jsonl python -m pytest -q -n 4 --dist worksteal \\
        -p benchmarks.test_times

Read::

    python -m benchmarks.test_times /tmp/times.jsonl [--top 30]

A test's time runs from the start of its set-up to the end of its tear-down (a cluster
fixture's namespaces are set up and removed there), as the worker that ran it saw it. The
summary gives the outcomes, the test-seconds, the run's wall time (first start to last end);
for each marker pyproject.toml declares, and for the tests with none but ``slow`` (stage 1),
the number of tests and their test-seconds; and the slowest tests. On N workers a stage's
wall time is about its test-seconds / N when the tests wait on processes, and longer when they
all want the same 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "GRADFLEET_TEST_TIMES"
OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = (yield).get_result()
    if report.outcome != "passed" and item.stash.get(OUTCOME, "passed") != "failed":
        item.stash[OUTCOME] = report.outcome  # a failed phase wins over a skipped one


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    start = time.time()
    yield
    path = os.environ.get(ENV)
    if path:
        line = {
            "test": item.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": start,
            "end": time.time(),
            "outcome": item.stash.get(OUTCOME, "passed"),
            "markers": sorted({m.name for m in item.iter_markers()}),
        }
        with open(path, "a") as f:  # one short write per line: workers' lines do not mix
            f.write(json.dumps(line) + "\n")


def declared_markers() -> list[str]:
    """The markers pyproject.toml declares (``slow`` and CI's second stage's), in its order."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    block = text.split("\nmarkers = [", 1)[1].split("\n]", 1)[0]
    return re.findall(r'^\s*"(\w+):', block, flags=re.M)


def summarize(rows: list[dict], top: int) -> str:
    declared = declared_markers()
    groups: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        took = r["end"] - r["start"]
        mine = [m for m in declared if m in r["markers"]]
        for m in mine:
            groups[m].append(took)
        if not set(mine) - {"slow"}:
            groups["(stage 1: none but slow)"].append(took)
    wall = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    outcomes = defaultdict(int)
    for r in rows:
        outcomes[r.get("outcome", "not recorded")] += 1
    lines = [f"{len(rows)} tests ({', '.join(f'{n} {o}' for o, n in outcomes.items())}), "
             f"{sum(r['end'] - r['start'] for r in rows):.0f} test-seconds, "
             f"wall {wall:.0f} s on {len({r['worker'] for r in rows})} worker(s)", "",
             "| marker | tests | test-seconds |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {g} | {len(t)} | {sum(t):.0f} |" for g, t in sorted(groups.items())]
    lines += ["", f"slowest {top}:"]
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[:top]:
        mine = ",".join(m for m in declared if m in r["markers"])
        lines.append(f"{r['end'] - r['start']:7.1f} s  {r['test']}  [{mine}]")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("times", type=Path, help="the JSON lines a run with the plugin wrote")
    parser.add_argument("--top", type=int, default=30, help="how many of the slowest to list")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.times.read_text().splitlines() if line.strip()]
    print(summarize(rows, args.top))


if __name__ == "__main__":
    main()
