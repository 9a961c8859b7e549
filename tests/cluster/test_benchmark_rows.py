"""The cluster benchmark's rows with dedicated server hosts: a job of 4 worker hosts and a
server host (static rendezvous, so the server's rank follows the workers') runs SyncReplicas
with its one server there and async EASGD with its centre there; both train, and the server
host's link carries the workers' traffic.  Every row's strategy comes from the CLI's strategy
table (``benchmarks.cluster.cluster_table``), its servers where the row says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.cluster import cluster
from benchmarks.cluster.cluster_table import Context, placement, table_strategy
from benchmarks.cluster.cluster_worker import build_model
from benchmarks.cluster.netcluster import unavailable_reason

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
PARAMS, UPDATES, WORKERS = 2e5, 12, 4


def test_rows_name_their_server_hosts() -> None:
    rows = {r.key: r for r in cluster.rows(WORKERS)}
    assert rows["sr-ded-one"].server_hosts == 1 and rows["easgd-ded"].server_hosts == 1
    assert rows["sr-ded"].server_hosts == rows["sr-ded-b"].server_hosts == WORKERS
    assert rows["sr-ded-b"].options["R"] == WORKERS - 1
    assert rows["sr-shard-ov"].options["overlap"] is True
    for key in ("sr-shard-ovs", "sr-shard-split-ovs"):  # streamed reads ride on overlap
        assert rows[key].options["stream"] is True and rows[key].options["overlap"] is True
    assert rows["sr-ded-split"].server_hosts == WORKERS
    for key in ("sr-ded-split", "sr-shard-split"):
        assert rows[key].options["assignment"] == "split" and rows[key].options["R"] == WORKERS
    assert all(r.server_hosts == 0 for k, r in rows.items() if "ded" not in k)
    for key, n in (("sr-ded-split-w2", 2), ("sr-ded-split-w4", 4), ("sr-shard-split-w2", 2)):
        assert rows[key].options["per_rank"] == n and rows[key].options["assignment"] == "split"
    for key in ("sr-shard-order-ov", "sr-shard-order-ovs", "sr-ded-order-ov", "sr-ded-order-ovs"):
        o = rows[key].options  # runs complete together only if every rank hosts several
        assert o["assignment"] == "backward_order" and o["per_rank"] == 2 and o["overlap"]
        assert o.get("stream", False) is key.endswith("ovs")
    for key, n in (("sr-shard-order4-ovs", 4), ("sr-ded-order4-ovs", 4), ("sr-ded-order8-ovs", 8)):
        o = rows[key].options
        assert o["assignment"] == "backward_order" and o["per_rank"] == n and o["stream"]
    assert rows["sr-shard-order4-ovs-b"].options == dict(rows["sr-shard-order4-ovs"].options, R=3)
    assert rows["sr-ded-order4-ovs-b"].options == dict(rows["sr-ded-order4-ovs"].options, R=3)
    assert rows["sr-ded-order4-ovs-b"].server_hosts == WORKERS
    # the transfer-only time starts after one untimed update, or one exchange cycle
    for key, r in rows.items():
        cycle = r.options.get("period", r.options.get("interval", 1))
        assert r.warmup_updates == cycle, key
    assert rows["easgd"].warmup_updates == 4 and rows["ma8"].warmup_updates == 8


def test_the_rows_for_changing_slowdowns_differ_from_the_laid_out_row_only_in_r() -> None:
    rows = {r.key: r for r in cluster.rows(WORKERS)}
    laid_out = rows["sr-shard-auto"]  # sharded over the workers, the model given
    for key, R in (("sr-r4", 4), ("sr-r3", 3), ("sr-r2", 2), ("sr-r-auto", "auto")):
        row = rows[key]
        assert row.options == dict(laid_out.options, R=R), key
        assert (row.strategy, row.kind, row.server_hosts) == ("sync-replicas", "sync", 0), key
    assert [r.key for r in cluster.adaptive_rows(2)] == ["sr-r2", "sr-r1", "sr-r-auto"]


def test_every_row_is_a_table_strategy_with_its_servers_where_the_row_says() -> None:
    """Slow-link layout: host 3's link is slow, so no server of a row that names none
    dedicated sits there; dedicated servers are the ranks after the workers."""
    fast = [0, 1, 2]
    table_names = {"compute": "none", "ddp": "ddp", "allreduce": "allreduce",
                   "sync-replicas": "sync-replicas", "easgd-async": "easgd",
                   "model-average": "model-average"}  # fmt: skip
    for row in cluster.rows(WORKERS):
        name, args = table_strategy(row.strategy, row.options, WORKERS)
        assert name == table_names[row.strategy], row.key
        dedicated = list(range(WORKERS, WORKERS + row.server_hosts))
        hosts = list(range(WORKERS + row.server_hosts))
        ctx = Context(1, WORKERS, 1, hosts, "10.0.0.2", fast, server_ranks=dedicated)
        placed = placement(name, row.options, ctx, last_step=9)
        o = row.options
        if name == "easgd":
            assert args["mode"] == "async" and args["period"] == o["period"]
            assert placed["server_rank"] == (WORKERS if o.get("centre") else 0), row.key
        if name != "sync-replicas":
            continue
        assert args["replicas_to_aggregate"] == o["R"] and args["total_num_replicas"] == WORKERS
        assert placed["last_step"] == 9 and placed["host"] == "10.0.0.2"
        if o.get("servers") == "default":  # the quick start: no server named, nothing set
            given = {"replicas_to_aggregate", "total_num_replicas"}  # but losses, if the row says
            assert set(args) == given | ({"max_losses"} if "max_losses" in o else set()), row.key
            assert args.get("max_losses", 0) == o.get("max_losses", 0), row.key
            assert "server_ranks" not in placed and placed["with_model"] is False
            continue
        if o.get("servers") == "none":  # backups without a server: every rank keeps the state
            assert args["transport"] == "allreduce", row.key
            assert args.get("max_losses", 0) == o.get("max_losses", 0), row.key
            assert "server_ranks" not in placed and placed["with_model"] is False
            continue
        servers = {"dedicated": dedicated, "sharded": fast}.get(o.get("servers", "one"), [0])
        assert placed["server_ranks"] == servers * o.get("per_rank", 1), row.key
        assert args["overlap"] is o.get("overlap", False)
        assert placed["stream_reads"] is o.get("stream", False)
        assert placed["nonfinite"] == ("apply" if o.get("overlap") else "raise"), row.key
        # "auto": the wrapper lays the shards out from the model; else as the row names
        assert placed["with_model"] is o.get("auto", False)
        assert args.get("shard_assignment") == (None if o.get("auto") else
                                                o.get("assignment", "bytes"))  # fmt: skip


def test_a_row_with_an_option_its_strategy_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"takes no options \['R'\]; allowed: interval"):
        table_strategy("model-average", {"R": 3}, WORKERS)
    with pytest.raises(ValueError, match="servers='two'; allowed: default, one, sharded"):
        table_strategy("sync-replicas", {"servers": "two"}, WORKERS)
    with pytest.raises(ValueError, match="replicas_to_aggregate=5 > total_num_replicas=4"):
        table_strategy("sync-replicas", {"R": 5}, WORKERS)
    with pytest.raises(ValueError, match="shard_assignment must be one of bytes"):
        table_strategy("sync-replicas", {"assignment": "rows"}, WORKERS)


@pytest.mark.multihost
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
def test_dedicated_server_host_rows_train(tmp_path: Path) -> None:
    argv = ["--params", str(PARAMS), "--updates", str(UPDATES), "--scenarios", "uniform",
            "--only", "sr-ded-one,easgd-ded", "--out", str(tmp_path), "--name", "t"]  # fmt: skip
    assert cluster.main(argv) == 0
    report = json.loads((tmp_path / "t.json").read_text())
    results = {r["row"]["key"]: r for r in report["results"]}
    assert sorted(results) == ["easgd-ded", "sr-ded-one"]
    for key, result in results.items():
        assert "error" not in result, result.get("error")
        assert result["updates_s"] > 0
        assert sorted(int(h) for h in result["links"]) == list(range(WORKERS + 1)), key
        # five training/serving processes ran on this machine's cores all along
        assert 0 < result["cpu"]["busy"] <= 1 and 0 <= result["cpu"]["steal"] < 1, result["cpu"]
    # EASGD's rate is the mean of the worker hosts' own rates (the server host trains not)
    per_host = results["easgd-ded"]["per_host_updates_s"]
    assert sorted(int(h) for h in per_host) == list(range(WORKERS))
    assert sum(per_host.values()) / WORKERS == pytest.approx(results["easgd-ded"]["updates_s"])
    # every update of R = N = 4 takes 4 pushes of the float32 model into the server host; the
    # link counters are sampled every 0.25 s, so the window between the first and last sample
    # inside the training phase may miss its ends, but over 12 updates (several seconds here)
    # at least one update's worth must show in the server link's bytes
    model = sum(p.numel() * 4 for p in build_model(PARAMS, 0).parameters())
    server = {int(h): v for h, v in results["sr-ded-one"]["links"].items()}[WORKERS]
    assert server["bytes"] >= WORKERS * model, (server, model)
