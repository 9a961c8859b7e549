"""Cluster benchmark: gradfleet's strategies against DDP on an emulated, network-bound cluster.

    python benchmarks/cluster/cluster.py [--hosts 4] [--link 200mbit] [--params 10e6] [--updates 6]
                                 [--scenarios uniform,slow-link,slow-compute,moving-straggler,
                                              transient] [--only ddp,...]

4 hosts are network namespaces on a bridge, each link shaped with tc tbf (``netcluster``); one
torchrun per host, c10d rendezvous on host 0, one worker per host (``cluster_worker``) training
a real MLP.  Scenarios (``--scenarios``; the first three by default): ``uniform``, every link
at ``--link``; ``slow-link``, host 3's link at 1/4 of it; ``slow-compute``, host 3 computing 2x
slower; and two whose slowdowns change, counted in each host's own training steps
(``cluster_slowdown``, the same schedule for every row): ``moving-straggler``, one host
``--straggler-factor`` x slower, the next one every ``--straggler-every`` steps, from host 3
on; ``transient``, each host on its own ``--transient-factor`` x slower for
``--transient-steps`` steps, a slowdown starting at each step with chance
``--transient-chance`` (``--slowdown-seed``).  A slowed step sleeps (f - 1) times the host's
calibrated compute time before its forward.  Servers (SyncReplicas' shards, EASGD's centre)
live on hosts with a fast link.

Per strategy and scenario: updates/s and samples/s in the training phase, the transfer-only
time of one update (communication on zero gradients), the compute-only time of one step (the
``compute`` row: no communication), wall time until host 0's loss (mean of 4 steps) reaches
``--target-loss``, each link's bytes/s (host-side interface counters, sampled every 0.25 s)
against its shaped rate, and for SyncReplicas the R of every update (``replicas_history``:
``sr-r-auto`` chooses it per update).  Writes ``<out>/<name>.json``, ``.md`` and ``.png``
(updates/s, updates/s over DDP's, busiest link use; R against the update number per scenario);
``--replot JSON...`` redraws a PNG from its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cluster import cluster_report  # noqa: E402
from benchmarks.cluster.cluster_slowdown import (  # noqa: E402
    MovingStraggler,
    Slowdown,
    SlowHost,
    Transient,
    to_spec,
)
from benchmarks.cluster.netcluster import Cluster, rate_bits, stop, unavailable_reason  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("cluster_worker.py")
SLOW = 3  # the host that is slowed in the uneven scenarios


@dataclass(frozen=True)
class Row:
    """One strategy configuration (``strategy``, ``options``:
    :mod:`benchmarks.cluster.cluster_table`). ``kind``: ``"sync"`` (one global update per step
    of every replica) or ``"local"`` (every local step is an update); ``R``: gradients per
    update; ``server_hosts``: extra hosts that only serve (dedicated servers, ranks after the
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
        Row("sr-default-ml", f"SyncReplicas, default options, R={n}, max_losses=1",
            "sync-replicas", {"R": n, "servers": "default", "max_losses": 1}),
        Row("sr-one", f"SyncReplicas, one server, R={n}", "sync-replicas", {"R": n}),
        Row("sr-one-b", f"SyncReplicas, one server, R={r} of {n}", "sync-replicas", {"R": r}),
        Row("sr-one-b-nostandby", f"SyncReplicas, one server without a standby, R={r} of {n}",
            "sync-replicas", {"R": r, "standby": False}),
        Row("sr-none-b", f"SyncReplicas, no server (the first R all-reduce), R={r} of {n}",
            "sync-replicas", {"R": r, "servers": "none"}),
        Row("sr-none-b-ml", f"SyncReplicas, no server, R={r} of {n}, max_losses=1",
            "sync-replicas", {"R": r, "servers": "none", "max_losses": 1}),
        Row("sr-none-b-first", f"SyncReplicas, no server, R={r} of {n}, hear_every_worker=False",
            "sync-replicas", {"R": r, "servers": "none", "hear": False}),
        Row("sr-none-auto", f"SyncReplicas, no server, R chosen per update (auto) of {n}",
            "sync-replicas", {"R": "auto", "servers": "none"}),
        Row("sr-one-auto-b", f"SyncReplicas, one server, model given, R={r} of {n}",
            "sync-replicas", {"R": r, "auto": True}),
        Row("sr-shard", f"SyncReplicas, sharded over workers, R={n}", "sync-replicas",
            {"R": n, "servers": "sharded"}),
        Row("sr-shard-b", f"SyncReplicas, sharded over workers, R={r} of {n}", "sync-replicas",
            {"R": r, "servers": "sharded"}),
        Row("sr-shard-b-standby", f"SyncReplicas, sharded over workers, a standby per shard, "
            f"R={r} of {n}", "sync-replicas", {"R": r, "servers": "sharded", "standby": True}),
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
        Row("sr-ded-one-nostandby", f"SyncReplicas, one dedicated server host without a "
            f"standby, R={n}", "sync-replicas", {"R": n, **dedicated, "standby": False},
            server_hosts=1),
        Row("sr-ded", f"SyncReplicas, sharded on {n} dedicated server hosts, R={n}",
            "sync-replicas", {"R": n, **dedicated}, server_hosts=n),
        Row("sr-ded-standby", f"SyncReplicas, sharded on {n} dedicated server hosts, a standby "
            f"per shard on the workers, R={n}", "sync-replicas",
            {"R": n, **dedicated, "standby": True}, server_hosts=n),
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
        Row("sr-ded-order8-s", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 8 per host, streamed reads, R={n}", "sync-replicas",
            {"R": n, **dedicated, **order, "per_rank": 8, **stream}, server_hosts=n),
        Row("sr-ded-order8-ovs", f"SyncReplicas, shards in backward order on {n} dedicated "
            f"server hosts, 8 per host, overlap, streamed reads, R={n}", "sync-replicas",
            {"R": n, **dedicated, **order, "per_rank": 8, **overlap, **stream}, server_hosts=n),
        *adaptive_rows(n),
        Row("easgd", "async EASGD, centre on a worker, period 4", "easgd-async",
            {"period": 4, "steps_scale": 2}, kind="local", transfer_updates=4, warmup_updates=4),
        Row("easgd-standby", "async EASGD, centre on a worker, its standby on another host, "
            "period 4", "easgd-async", {"period": 4, "steps_scale": 2, "standby": True},
            kind="local", transfer_updates=4, warmup_updates=4),
        Row("easgd-ded", "async EASGD, centre on a dedicated server host, period 4",
            "easgd-async", {"period": 4, "steps_scale": 2, "centre": "dedicated",
                            "standby": False}, kind="local",
            transfer_updates=4, warmup_updates=4, server_hosts=1),
        Row("easgd-ded-standby", "async EASGD, centre on a dedicated server host, its standby "
            "on a worker host, period 4", "easgd-async",
            {"period": 4, "steps_scale": 2, "centre": "dedicated", "standby": True},
            kind="local", transfer_updates=4, warmup_updates=4, server_hosts=1),
        Row("ma8", "ModelAverage, interval 8", "model-average",
            {"interval": 8, "steps_scale": 2}, kind="local", transfer_updates=8,
            warmup_updates=8),
    ]  # fmt: skip


def adaptive_rows(world: int) -> list[Row]:
    """SyncReplicas with R = N, N-1, N-2 of N (keys ``sr-r<R>``) and R chosen per update
    (``sr-r-auto``, ``replicas_to_aggregate="auto"``), for the scenarios whose slowdowns
    change: servers sharded over the workers with the model given (laid out for the job:
    backward order, 4 shards per rank, streamed reads), as ``sr-shard-auto``.  Over the workers
    rather than on dedicated hosts: the rows run in the same 4-host job as DDP, on as many
    machines, and no server process adds to the shared cores."""
    n = world
    shard = {"servers": "sharded", "auto": True}
    label = "SyncReplicas, sharded over workers, model given"
    fixed = [Row(f"sr-r{R}", f"{label}, R={R} of {n}", "sync-replicas", {"R": R, **shard})
             for R in (n, n - 1, n - 2) if R >= 1]  # fmt: skip
    auto = Row("sr-r-auto", f"{label}, R chosen per update (auto) of {n}", "sync-replicas",
               {"R": "auto", **shard})  # fmt: skip
    return [*fixed, auto]


SCENARIOS = {
    "uniform": "every link at the base rate",
    "slow-link": f"host {SLOW}'s link at 1/4 of the rate",
    "slow-compute": f"host {SLOW} computes 2x slower",
    "moving-straggler": "one host computes --straggler-factor x slower, from host "
    f"{SLOW} on, and the next host every --straggler-every of its own steps",
    "transient": "each host, independently, --transient-factor x slower for --transient-steps "
    "steps, a slowdown starting at each step with chance --transient-chance (seeded)",
}
DEFAULT_SCENARIOS = ("uniform", "slow-link", "slow-compute")  # as before the changing ones


def slowdown(scenario: str, args: argparse.Namespace) -> Slowdown | None:
    """The compute slowdown of ``scenario`` (None: every host at full speed)."""
    if scenario == "slow-compute":
        return SlowHost(SLOW, 2.0)
    if scenario == "moving-straggler":
        return MovingStraggler(args.hosts, args.straggler_factor, args.straggler_every,
                               SLOW % args.hosts)  # fmt: skip
    if scenario == "transient":
        return Transient(args.transient_factor, args.transient_chance, args.transient_steps,
                         args.slowdown_seed)  # fmt: skip
    return None


def describe(scenario: str, args: argparse.Namespace) -> str:
    """The scenario in words, with this run's numbers."""
    if scenario == "moving-straggler":
        return (f"one host computes {args.straggler_factor:g}x slower, from host {SLOW} on, and "
                f"the next host every {args.straggler_every} of its own steps")  # fmt: skip
    if scenario == "transient":
        return (f"each host, independently, {args.transient_factor:g}x slower for "
                f"{args.transient_steps} steps, a slowdown starting at each step with chance "
                f"{args.transient_chance:g} (seed {args.slowdown_seed})")  # fmt: skip
    return SCENARIOS[scenario]


def quarter(rate: str) -> str:
    return f"{int(rate_bits(rate) / 4 / 1000)}kbit"


def _at_least(kind: type, low: float) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its "invalid" message
    return convert


def _probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return value


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
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                   help=f"comma-separated, of {', '.join(SCENARIOS)} (default: the first "
                   "three)")  # fmt: skip
    p.add_argument("--straggler-factor", type=_at_least(float, 1), default=3.0,
                   help="moving-straggler: how many times slower the straggler is")  # fmt: skip
    p.add_argument("--straggler-every", type=_at_least(int, 1), default=4,
                   help="moving-straggler: the straggler's own steps before the next host "
                   "is the straggler")  # fmt: skip
    p.add_argument("--transient-factor", type=_at_least(float, 1), default=4.0,
                   help="transient: how many times slower a slowed host computes")  # fmt: skip
    p.add_argument("--transient-chance", type=_probability, default=0.1,
                   help="transient: chance that a host's slowdown starts at a step")  # fmt: skip
    p.add_argument("--transient-steps", type=_at_least(int, 1), default=3,
                   help="transient: steps one slowdown lasts")  # fmt: skip
    p.add_argument("--slowdown-seed", type=int, default=0,
                   help="transient: seed of the schedule (the same for every row)")  # fmt: skip
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
    from benchmarks.cluster.cluster_table import table_strategy  # torch: not for --replot

    for row in chosen:  # checked as the CLI checks --strategy, before any host starts
        try:
            table_strategy(row.strategy, row.options, args.hosts)
        except ValueError as err:
            raise SystemExit(f"row {row.key}: {err}") from None
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
        "command": "python benchmarks/cluster/cluster.py " + " ".join(argv or sys.argv[1:]),
        "wall_s": time.time() - started,
        "load_before": load,
        "cores": os.cpu_count(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "scenarios": {s: describe(s, args) for s in scenarios},
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
    slow = slowdown(scenario, args)
    plan = [{"key": r.key, "strategy": r.strategy, "options": r.options,
             "transfer_updates": r.transfer_updates, "warmup_updates": r.warmup_updates}
            for r in chosen]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gfc-run-") as tmp:
        out = Path(tmp)
        script = [str(WORKER), "--rows", json.dumps(plan), "--params", str(args.params),
                  "--batch", str(args.batch), "--device-time", str(args.device_time),
                  "--updates", str(args.updates),
                  "--slowdown", json.dumps(to_spec(slow)) if slow else "",
                  "--workers", str(args.hosts),
                  "--fast-hosts", ",".join(map(str, fast)), "--deadline", str(args.deadline),
                  "--out", str(out / "ranks")]  # fmt: skip
        port = 29500 + (os.getpid() + int(time.time())) % 400
        procs = cluster.torchrun(
            script, cwd=ROOT, port=port, logs=out,
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
