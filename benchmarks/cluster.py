"""Cluster benchmark: gradfleet's strategies against DDP on an emulated, network-bound cluster.

    python benchmarks/cluster.py [--hosts 4] [--link 200mbit] [--params 10e6] [--updates 6]
                                 [--scenarios uniform,slow-link,slow-compute] [--only ddp,...]

4 hosts are network namespaces on a bridge, each link shaped with tc tbf (``netcluster``); one
torchrun per host, c10d rendezvous on host 0, one worker per host (``cluster_worker``) training
a real MLP.  Scenarios: every link at ``--link``; host 3's link at 1/4 of it; host 3 computing
2x slower.  Servers (SyncReplicas' shards, EASGD's centre) live on hosts with a fast link.

Per strategy and scenario: updates/s and samples/s in the training phase, the transfer-only
time of one update (communication on zero gradients), the compute-only time of one step (the
``compute`` row: no communication), wall time until host 0's loss (mean of 4 steps) reaches
``--target-loss``, and each link's bytes/s (host-side interface counters, sampled every
0.25 s) against its shaped rate.  Writes ``<out>/<name>.json``, ``.md`` and ``.png`` (updates/s,
updates/s over DDP's, busiest link use); ``--replot JSON...`` redraws a PNG from its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cluster_report  # noqa: E402
from benchmarks.netcluster import Cluster, rate_bits, stop, unavailable_reason  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "cluster_worker.py"
SLOW = 3  # the host that is slowed in the uneven scenarios


@dataclass(frozen=True)
class Row:
    """One strategy configuration. ``kind``: ``"sync"`` (one global update per step of every
    replica) or ``"local"`` (every local step is an update); ``R``: gradients per update;
    ``server_hosts``: extra hosts that only serve (dedicated servers, ranks after the
    workers), at the base link rate."""

    key: str
    label: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    kind: str = "sync"
    transfer_updates: int = 2
    warmup_updates: int = 1  # before the transfer-only time: one update, or one cycle
    server_hosts: int = 0


def rows(world: int) -> list[Row]:
    """The strategies measured (``world``: worker hosts; the dedicated server hosts of a row
    come on top)."""
    n, r = world, world - 1
    shard = {"servers": "sharded"}
    overlap = {"overlap": True, "nonfinite": "apply"}  # sharded overlap needs "apply"
    dedicated = {"servers": "dedicated"}
    split = {"assignment": "split"}  # large parameters cut into pieces over the shards
    stream = {"stream": True}  # the reads stream into the next forward (stream_reads)
    # pieces in runs in backward's order, every server rank twice: with overlap, the runs a
    # gradient completes go out to every server at once (shard_assignment="backward_order")
    order = {"assignment": "backward_order", "per_rank": 2}
    return [
        Row("compute", "compute only (no communication)", "compute", kind="local"),
        Row("ddp", "DDP (bucketed all-reduce, overlapped)", "ddp"),
        Row("allreduce", "gloo all-reduce after backward", "allreduce"),
        Row("sr-default", f"SyncReplicas, default options, R={n}", "sync-replicas",
            {"R": n, "servers": "default"}),
        Row("sr-one", f"SyncReplicas, one server, R={n}", "sync-replicas", {"R": n}),
        Row("sr-one-b", f"SyncReplicas, one server, R={r} of {n}", "sync-replicas", {"R": r}),
        Row("sr-shard", f"SyncReplicas, sharded over workers, R={n}", "sync-replicas",
            {"R": n, "servers": "sharded"}),
        Row("sr-shard-b", f"SyncReplicas, sharded over workers, R={r} of {n}", "sync-replicas",
            {"R": r, "servers": "sharded"}),
        Row("sr-shard-ov", f"SyncReplicas, sharded over workers, overlap, R={n}",
            "sync-replicas", {"R": n, **shard, **overlap}),
        Row("sr-shard-ovs", f"SyncReplicas, sharded over workers, overlap, streamed reads, "
            f"R={n}", "sync-replicas", {"R": n, **shard, **overlap, **stream}),
        Row("sr-shard-split", f"SyncReplicas, split shards over workers, R={n}",
            "sync-replicas", {"R": n, **shard, **split}),
        Row("sr-shard-split-b", f"SyncReplicas, split shards over workers, R={r} of {n}",
            "sync-replicas", {"R": r, **shard, **split}),
        Row("sr-shard-split-ov", f"SyncReplicas, split shards over workers, overlap, R={n}",
            "sync-replicas", {"R": n, **shard, **split, **overlap}),
        Row("sr-shard-split-ovs", f"SyncReplicas, split shards over workers, overlap, streamed "
            f"reads, R={n}", "sync-replicas", {"R": n, **shard, **split, **overlap, **stream}),
        Row("sr-shard-order-ov", f"SyncReplicas, shards in backward order over workers, 2 per "
            f"host, overlap, R={n}", "sync-replicas", {"R": n, **shard, **order, **overlap}),
        Row("sr-shard-order-ovs", f"SyncReplicas, shards in backward order over workers, 2 per "
            f"host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **shard, **order, **overlap, **stream}),
        Row("sr-shard-order4-ovs", f"SyncReplicas, shards in backward order over workers, 4 "
            f"per host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **shard, **order, "per_rank": 4, **overlap, **stream}),
        Row("sr-shard-auto", f"SyncReplicas, sharded over workers, model given, R={n}",
            "sync-replicas", {"R": n, **shard, "auto": True}),
        Row("sr-ded-auto", f"SyncReplicas, sharded on {n} dedicated server hosts, model given, "
            f"R={n}", "sync-replicas", {"R": n, **dedicated, "auto": True}, server_hosts=n),
        Row("sr-shard-order4-s", f"SyncReplicas, shards in backward order over workers, 4 "
            f"per host, streamed reads, R={n}", "sync-replicas",
            {"R": n, **shard, **order, "per_rank": 4, **stream}),
        Row("sr-shard-order4-ovs-b", f"SyncReplicas, shards in backward order over workers, 4 "
            f"per host, overlap, streamed reads, R={r} of {n}", "sync-replicas",
            {"R": r, **shard, **order, "per_rank": 4, **overlap, **stream}),
        Row("sr-shard-order8-ovs", f"SyncReplicas, shards in backward order over workers, 8 "
            f"per host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **shard, **order, "per_rank": 8, **overlap, **stream}),
        Row("sr-ded-one", f"SyncReplicas, one dedicated server host, R={n}", "sync-replicas",
            {"R": n, **dedicated}, server_hosts=1),
        Row("sr-ded", f"SyncReplicas, sharded on {n} dedicated server hosts, R={n}",
            "sync-replicas", {"R": n, **dedicated}, server_hosts=n),
        Row("sr-ded-split", f"SyncReplicas, split shards on {n} dedicated server hosts, R={n}",
            "sync-replicas", {"R": n, **dedicated, **split}, server_hosts=n),
        Row("sr-ded-split-w2", f"SyncReplicas, split shards on {n} dedicated server hosts, "
            f"2 shards per host, R={n}", "sync-replicas",
            {"R": n, **dedicated, **split, "per_rank": 2}, server_hosts=n),
        Row("sr-ded-split-w4", f"SyncReplicas, split shards on {n} dedicated server hosts, "
            f"4 shards per host, R={n}", "sync-replicas",
            {"R": n, **dedicated, **split, "per_rank": 4}, server_hosts=n),
        Row("sr-shard-split-w2", f"SyncReplicas, split shards over workers, 2 shards per host, "
            f"R={n}", "sync-replicas", {"R": n, **shard, **split, "per_rank": 2}),
        Row("sr-shard-split-w2-b", f"SyncReplicas, split shards over workers, 2 shards per host, "
            f"R={r} of {n}", "sync-replicas", {"R": r, **shard, **split, "per_rank": 2}),
        Row("sr-ded-b", f"SyncReplicas, sharded on {n} dedicated server hosts, R={r} of {n}",
            "sync-replicas", {"R": r, **dedicated}, server_hosts=n),
        Row("sr-ded-ov", f"SyncReplicas, sharded on {n} dedicated server hosts, overlap, R={n}",
            "sync-replicas", {"R": n, **dedicated, **overlap}, server_hosts=n),
        Row("sr-ded-order-ov", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 2 per host, overlap, R={n}", "sync-replicas",
            {"R": n, **dedicated, **order, **overlap}, server_hosts=n),
        Row("sr-ded-order-ovs", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 2 per host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **dedicated, **order, **overlap, **stream}, server_hosts=n),
        Row("sr-ded-order4-ovs", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 4 per host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **dedicated, **order, "per_rank": 4, **overlap, **stream}, server_hosts=n),
        Row("sr-ded-order4-ovs-b", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 4 per host, overlap, streamed reads, R={r} of {n}", "sync-replicas",
            {"R": r, **dedicated, **order, "per_rank": 4, **overlap, **stream}, server_hosts=n),
        Row("sr-ded-order8-ovs", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 8 per host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **dedicated, **order, "per_rank": 8, **overlap, **stream}, server_hosts=n),
        Row("easgd", "async EASGD, centre on a worker, period 4", "easgd-async",
            {"period": 4, "steps_scale": 2}, kind="local", transfer_updates=4, warmup_updates=4),
        Row("easgd-ded", "async EASGD, centre on a dedicated server host, period 4",
            "easgd-async", {"period": 4, "steps_scale": 2, "centre": "dedicated"}, kind="local",
            transfer_updates=4, warmup_updates=4, server_hosts=1),
        Row("ma8", "ModelAverage, interval 8", "model-average",
            {"interval": 8, "steps_scale": 2}, kind="local", transfer_updates=8,
            warmup_updates=8),
    ]  # fmt: skip


SCENARIOS = {
    "uniform": "every link at the base rate",
    "slow-link": f"host {SLOW}'s link at 1/4 of the rate",
    "slow-compute": f"host {SLOW} computes 2x slower",
}


def quarter(rate: str) -> str:
    return f"{int(rate_bits(rate) / 4 / 1000)}kbit"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--link", default="200mbit")
    p.add_argument("--queue-ms", type=int, default=20,
                   help="each link's queue (tbf latency): packets that would wait longer are "
                   "dropped, as a switch port's buffer drops them")  # fmt: skip
    p.add_argument("--params", type=float, default=10e6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device-time", type=float, default=0.0,
                   help="seconds of emulated accelerator time per forward/backward (sleeps: "
                   "the CPU stays free, as while a GPU computes)")  # fmt: skip
    p.add_argument("--updates", type=int, default=6, help="training updates per strategy")
    p.add_argument("--target-loss", type=float, default=1.33)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--only", default="", help="comma-separated row keys (default: all)")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds per scenario")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="cluster")
    p.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                   help="redraw each given result's PNG from its JSON, beside it, and exit "
                   "(runs nothing, needs no root)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.replot:
        for report in args.replot:
            print(cluster_report.replot(report))
        return 0
    reason = unavailable_reason()
    if reason:
        print(f"cluster benchmark skipped: {reason}")
        return 2
    chosen = [r for r in rows(args.hosts) if not args.only or r.key in args.only.split(",")]
    scenarios = args.scenarios.split(",")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; allowed: {sorted(SCENARIOS)}")
    # what else kept the machine busy: the 1-minute load average before the run
    load, started, results = os.getloadavg()[0], time.time(), []
    args.out.mkdir(parents=True, exist_ok=True)
    servers = max([r.server_hosts for r in chosen], default=0)
    with Cluster(args.hosts + servers, args.link, latency_ms=args.queue_ms) as cluster:
        for scenario in scenarios:
            slow_rate = quarter(args.link) if scenario == "slow-link" else args.link
            for h in range(args.hosts + servers):
                cluster.shape(h, slow_rate if h == SLOW else args.link)
            for result in run_scenario(cluster, chosen, scenario, args):
                results.append(result)
                print(cluster_report.line(result), flush=True)
    report = {
        "machine": cluster_report.machine(),
        "command": "python benchmarks/cluster.py " + " ".join(argv or sys.argv[1:]),
        "wall_s": time.time() - started,
        "load_before": load,
        "cores": os.cpu_count(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "scenarios": {s: SCENARIOS[s] for s in scenarios},
        "results": results,
    }
    cluster_report.write(report, args.out, args.name)
    return 0


def run_scenario(
    cluster: Cluster, chosen: list[Row], scenario: str, args: argparse.Namespace
) -> list[dict]:
    """One job per number of dedicated server hosts (rows without: every host trains),
    results in the order of ``chosen``."""
    by_key: dict[str, dict] = {}
    for servers in sorted({r.server_hosts for r in chosen}):
        rows_here = [r for r in chosen if r.server_hosts == servers]
        for row, result in zip(rows_here, run_job(cluster, rows_here, scenario, args, servers)):
            by_key[row.key] = result
    return [by_key[r.key] for r in chosen]


def run_job(
    cluster: Cluster, chosen: list[Row], scenario: str, args: argparse.Namespace, servers: int
) -> list[dict]:
    """One job (one torchrun per worker host, and per server host) running every row in turn;
    the links are sampled all along and each row's figures come from its own time window.
    Server hosts come after the workers, so their ranks do too (static rendezvous)."""
    fast = [h for h in range(args.hosts) if not (scenario == "slow-link" and h == SLOW)]
    factor = {SLOW: {"GF_CLUSTER_COMPUTE_FACTOR": "2"}} if scenario == "slow-compute" else {}
    plan = [{"key": r.key, "strategy": r.strategy, "options": r.options,
             "transfer_updates": r.transfer_updates, "warmup_updates": r.warmup_updates}
            for r in chosen]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gfc-run-") as tmp:
        out = Path(tmp)
        script = [str(WORKER), "--rows", json.dumps(plan), "--params", str(args.params),
                  "--batch", str(args.batch), "--device-time", str(args.device_time),
                  "--updates", str(args.updates),
                  "--workers", str(args.hosts),
                  "--fast-hosts", ",".join(map(str, fast)), "--deadline", str(args.deadline),
                  "--out", str(out / "ranks")]  # fmt: skip
        port = 29500 + (os.getpid() + int(time.time())) % 400
        procs = cluster.torchrun(
            script, cwd=ROOT, port=port, env_per_host=factor, logs=out,
            rdzv_id=f"gfc-{scenario}-{servers}", hosts=args.hosts + servers, static=servers > 0,
        )  # fmt: skip
        samples, codes = [], None
        end = time.monotonic() + args.deadline + 30
        try:
            while codes is None and time.monotonic() < end:
                samples.append((time.time(), cluster.counters(), cluster_report.cpu_times()))
                codes = [p.poll() for p in procs]
                codes = None if None in codes else codes
                time.sleep(0.25)
        finally:
            if codes is None:
                dump_stacks(cluster)
            stop(procs)
        logs = {h: (out / f"host{h}.log").read_text()[-4000:]
                for h in range(args.hosts + servers)}  # fmt: skip
        ranks = [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank-*.json"))]
    failed = "deadline passed" if codes is None else (f"exit codes {codes}" if any(codes) else "")
    results = []
    for i, row in enumerate(chosen):
        rates = {h: cluster.rates[h] for h in range(args.hosts + servers)}
        base = {"scenario": scenario, "row": asdict(row), "rates": rates}
        records = [r[i] for r in ranks if len(r) > i]
        if len(records) != args.hosts:
            results.append({**base, "error": failed or "missing rank records", "logs": logs})
            continue
        results.append({**base, **cluster_report.summarise(row, records, samples,
                                                           rates, args)})  # fmt: skip
    return results


def dump_stacks(cluster: Cluster) -> None:
    """Ask every worker for its threads' tracebacks (faulthandler on SIGUSR1) before the kill."""
    import subprocess

    for h in cluster.hosts:
        listed = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True)
        for pid in listed.stdout.split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if Path(f"/proc/{pid}").exists() \
                else b""  # fmt: skip
            if b"cluster_worker.py" in cmdline and b"torch.distributed.run" not in cmdline:
                os.kill(int(pid), signal.SIGUSR1)
    time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
