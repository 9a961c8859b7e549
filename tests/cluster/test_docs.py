"""docs/cluster.md: every ```python block runs, and does what the page says it does; its table of
updates/s against DDP quotes the stored results."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from benchmarks.cluster.netcluster import PREFIX, unavailable_reason

from .netns import ROOT

PAGE = ROOT / "docs" / "cluster.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


# "Updates per second against DDP": each row's label -> per column, (stored result, row key)
TABLE = {
    "DDP (bucketed all-reduce, overlapped with backward)": {
        "uniform": ("cluster-uniform", "ddp"),
        "slow-link": ("cluster-slow-link", "ddp"),
    },
    "SyncReplicas, split shards over the workers, R = 4": {
        "uniform": ("cluster-uniform", "sr-shard-split"),
    },
    "SyncReplicas, split shards over the fast workers, R = 3 of 4": {
        "slow-link": ("cluster-slow-link", "sr-shard-split-b"),
    },
    "the same in backward order, 4 shards per host, overlap, streamed reads, AMD VM": {
        "slow-link": ("cluster-withheld-slow", "sr-shard-order4-ovs-b"),
    },
    "SyncReplicas, split shards on 4 dedicated server hosts, R = 4": {
        "uniform": ("cluster-uniform", "sr-ded-split"),
    },
    "the same, 4 shards per server host (read-ahead, paced pushes), AMD VM": {
        "uniform": ("cluster-paced", "sr-ded-split-w4"),
    },
    "async EASGD, centre on a dedicated host, period 4": {
        "uniform": ("cluster-uniform", "easgd-ded"),
    },
    "ModelAverage, interval 8": {
        "uniform": ("cluster-uniform", "ma8"),
        "slow-link": ("cluster-slow-link", "ma8"),
    },
}


def _quoted(result: str, scenario: str, key: str) -> str:
    """A cell as the page writes it: updates/s (its ratio to DDP's in the same run)."""
    report = json.loads((ROOT / "benchmarks" / "results" / f"{result}.json").read_text())
    runs = {r["row"]["key"]: r for r in report["results"] if r["scenario"] == scenario}
    assert "AMD" in report["machine"] or "Intel" in report["machine"]
    updates_s = runs[key]["updates_s"]
    return f"{updates_s:.3f} ({updates_s / runs['ddp']['updates_s']:.2f})"


def test_the_updates_table_quotes_the_stored_results() -> None:
    section = PAGE.read_text().split("### Updates per second against DDP")[1].split("\n#")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    cells = {r.strip("| ").split(" | ")[0]: r.strip("|").split("|")[1:] for r in rows}
    assert set(cells) == set(TABLE)
    for label, columns in TABLE.items():
        uniform, slow_link = (c.strip() for c in cells[label])
        expected = {s: _quoted(result, s, key) for s, (result, key) in columns.items()}
        assert uniform == expected.get("uniform", ""), label
        assert slow_link == expected.get("slow-link", ""), label
        machine = "AMD" if label.endswith("AMD VM") else "Intel"
        for result, _ in columns.values():  # the row names the machine its result ran on
            report = json.loads((ROOT / "benchmarks" / "results" / f"{result}.json").read_text())
            assert machine in report["machine"], (label, result)


DEFAULTS = {  # "Default options against the best hand-set ones": label -> row key
    "DDP": "ddp",
    "SyncReplicas, default options": "sr-default",
    "SyncReplicas, one server on rank 0": "sr-one",
    "SyncReplicas, sharded over the workers, no other option": "sr-shard",
    "SyncReplicas, shards in backward order, 4 per host, overlap, streamed reads (best hand-set)": (
        "sr-shard-order4-ovs"
    ),
}


LAID_OUT = {  # the second table of that section, from ``cluster-layout``
    "DDP": "ddp",
    "SyncReplicas, shards named over the workers, no model": "sr-shard",
    "SyncReplicas, shards named over the workers, model given": "sr-shard-auto",
    "SyncReplicas, 4 dedicated server hosts, model given": "sr-ded-auto",
}


def test_the_defaults_tables_quote_the_stored_results() -> None:
    section = PAGE.read_text().split("### Default options against the best hand-set ones")[1]
    tables = section.split("\n#")[0].split("| row (R = 4 of 4) | updates/s (x DDP) |")[1:]
    assert len(tables) == 2
    for table, (result, labels) in zip(
        tables, [("cluster-defaults", DEFAULTS), ("cluster-layout", LAID_OUT)], strict=True
    ):
        rows = [line for line in table.split("\n\n")[0].splitlines() if line.startswith("| ")]
        cells = dict(r.strip("| ").split(" | ") for r in rows)
        assert set(cells) == set(labels), result
        for label, key in labels.items():
            assert cells[label] == _quoted(result, "uniform", key), (result, label)


PACED_PER_RANK = {  # the third table of that section, from ``cluster-pacing-per-rank``
    "DDP": "ddp",
    "SyncReplicas, shards named over the workers, model given": "sr-shard-auto",
    "SyncReplicas, 4 dedicated server hosts, model given": "sr-ded-auto",
    "SyncReplicas, shards in backward order over the workers, 4 per host, overlap, streamed "
    "reads (best hand-set)": "sr-shard-order4-ovs",
    "SyncReplicas, the same on 4 dedicated server hosts (best hand-set)": "sr-ded-order4-ovs",
}


def test_the_paced_per_rank_table_quotes_the_stored_results() -> None:
    section = PAGE.read_text().split("### Default options against the best hand-set ones")[1]
    table = section.split("| row (R = 4 of 4), pushes paced per server rank |")[1]
    rows = [line for line in table.split("\n\n")[0].splitlines() if line.startswith("| ")]
    cells = dict(r.strip("| ").split(" | ") for r in rows)
    assert set(cells) == set(PACED_PER_RANK)
    for label, key in PACED_PER_RANK.items():
        assert cells[label] == _quoted("cluster-pacing-per-rank", "uniform", key), label


ONE_SERVER = {  # "Backup workers with one server", from ``cluster-one-server``
    "DDP (R = 4 of 4)": "ddp",
    "SyncReplicas, one server on rank 0, no model": "sr-one-b",
    "SyncReplicas, one server on rank 0, model given": "sr-one-auto-b",
}


def test_the_one_server_table_quotes_the_stored_results() -> None:
    section = PAGE.read_text().split("### Backup workers with one server")[1].split("\n#")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    cells = dict(r.strip("| ").split(" | ") for r in rows)
    assert set(cells) == set(ONE_SERVER)
    for label, key in ONE_SERVER.items():
        assert cells[label] == _quoted("cluster-one-server", "uniform", key), label


NO_SERVER = {  # "Backup workers without a server", from ``cluster-serverless-backups``
    "DDP (R = 4 of 4)": "ddp",
    "SyncReplicas, one server on rank 0": "sr-one-b",
    "SyncReplicas, sharded over the workers": "sr-shard-b",
    'SyncReplicas, no server (`transport="allreduce"`)': "sr-none-b",
}


def test_the_no_server_table_quotes_the_stored_results() -> None:
    section = PAGE.read_text().split("### Backup workers without a server")[1].split("\n#")[0]
    table = section.split("--name cluster-serverless-backups\n\n")[1].split("\n\n")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    cells = {r.strip("| ").split(" | ")[0]: r.strip("| ").split(" | ")[1:] for r in rows}
    assert set(cells) == set(NO_SERVER)
    for label, key in NO_SERVER.items():
        expected = [
            _quoted("cluster-serverless-backups", s, key)
            for s in ("uniform", "slow-link", "slow-compute")
        ]
        assert cells[label] == expected, label


def test_the_cost_of_losses_allowed_quotes_the_stored_result() -> None:
    section = PAGE.read_text().split("### Backup workers without a server")[1].split("\n#")[0]
    report = json.loads((ROOT / "benchmarks/results/cluster-serverless-losses.json").read_text())
    runs = {r["row"]["key"]: r["updates_s"] for r in report["results"]}
    said = (
        f"made {runs['sr-none-b-ml']:.3f} updates/s against {runs['sr-none-b']:.3f} without\n"
        f"it, and DDP {runs['ddp']:.3f}"
    )
    assert said in section


def test_the_who_is_heard_table_quotes_the_stored_result() -> None:
    section = PAGE.read_text().split("### Backup workers without a server")[1].split("\n#")[0]
    report = json.loads((ROOT / "benchmarks/results/cluster-who-is-heard.json").read_text())
    runs = {r["row"]["key"]: r for r in report["results"]}
    for label, key in (("`hear_every_worker=True` (default)", "sr-none-b"),
                       ("`hear_every_worker=False`", "sr-none-b-first")):  # fmt: skip
        run = runs[key]
        shares = ", ".join(f"{run['shares'][str(h)]:.2f}" for h in range(4))
        waited = ", ".join(
            f"{w:.1f}" if w else "0" for w in (run["deference"][str(h)]["waited"] for h in range(4))
        )
        assert f"| {label} | {run['updates_s']:.3f} | {shares} | {waited} |" in section, label


def test_the_serverless_auto_table_quotes_the_stored_result() -> None:
    section = PAGE.read_text().split("**Without a server.**")[1].split("\n#")[0]
    report = json.loads((ROOT / "benchmarks/results/cluster-serverless-auto.json").read_text())
    runs = {(r["scenario"], r["row"]["key"]): r for r in report["results"]}

    def cell(run: dict, with_r: bool) -> str:
        text = f"{run['time_to_target_s']:.1f} / {run['updates_s']:.3f}"
        if with_r:
            h = run["replicas_history"][run["first_update"] :]
            text += f", R {sum(h) / len(h):.2f} ({min(h)}-{max(h)})"
        return text

    for s in ("uniform", "slow-compute"):
        cells = [cell(runs[(s, "sr-default")], False), cell(runs[(s, "sr-r-auto")], True),
                 cell(runs[(s, "sr-none-auto")], True)]  # fmt: skip
        assert f"| {s} | " + " | ".join(cells) + " |" in section, s


def test_the_page_has_python_blocks() -> None:
    assert len(_blocks()) == 2


def test_reading_the_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(_blocks()[1], namespace)  # noqa: S102 - the page's own example
    # the page: DDP's updates/s per scenario, and each link's use against its shaped rate
    assert set(namespace["ddp"]) == {"uniform", "slow-link", "slow-compute"}
    assert all(v > 0 for v in namespace["ddp"].values())
    assert all(0 <= u <= 1.1 for u in namespace["use"].values())


@pytest.mark.multihost
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
def test_an_emulated_cluster_from_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(_blocks()[0], namespace)  # noqa: S102 - the page's own example
    # the page: two hosts with addresses, host 1 at 25 Mbit/s, and everything removed after
    assert len(namespace["addresses"]) == 2 and namespace["rates"] == {0: "100mbit", 1: "25mbit"}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace["prefix"] not in listed and namespace["prefix"].startswith(PREFIX)


ADAPTIVE_ROWS = {
    "DDP": "ddp",
    "R = 4": "sr-r4",
    "R = 3": "sr-r3",
    "R = 2": "sr-r2",
    "auto": "sr-r-auto",
}


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def test_the_adaptive_table_quotes_the_stored_results() -> None:
    """ "Backup workers that tune themselves": per scenario, each row's time to the target loss
    and updates/s, and auto's R per update, as ``cluster-adaptive`` recorded them."""
    report = json.loads((ROOT / "benchmarks" / "results" / "cluster-adaptive.json").read_text())
    section = PAGE.read_text().split("### Backup workers that tune themselves")[1].split("\n#")[0]
    section = section.split("**Without a server.**")[0]  # its own table: the next test
    header, *rows = [line for line in section.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[1 : 1 + len(ADAPTIVE_ROWS)] == list(ADAPTIVE_ROWS)
    rows = [r for r in rows if not set(r) <= set("|- ")]
    scenarios = {r["scenario"] for r in report["results"]}
    assert {r.strip("| ").split(" | ")[0] for r in rows} == scenarios
    for row in rows:
        scenario, *cells = (c.strip() for c in row.strip("|").split("|"))
        runs = {r["row"]["key"]: r for r in report["results"] if r["scenario"] == scenario}
        for cell, key in zip(cells, ADAPTIVE_ROWS.values(), strict=False):
            run = runs[key]
            expected = f"{_seconds(run['time_to_target_s'])} / {run['updates_s']:.3f}"
            assert cell == expected, (scenario, key)
        history = runs["sr-r-auto"]["replicas_history"][runs["sr-r-auto"]["first_update"] :]
        mean = f"{sum(history) / len(history):.2f} ({min(history)}-{max(history)})"
        assert cells[len(ADAPTIVE_ROWS)] == mean, scenario
