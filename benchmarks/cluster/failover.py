"""Failover on the emulated cluster: a host lost mid-run, launched as users launch.

    python benchmarks/cluster/failover.py [--hosts 4] [--link 200mbit] [--params 1e6]
                                          [--steps 40] [--kill-at 15]
                                          [--only chief,shard,dedicated,allreduce,easgd]
                                          [--only ...,torchft,torchft-fast,ddp]
                                          [--name failover]

Each case is one ``gradfleet train`` job under the torchrun recipe of docs/failures.md: one
``torchrun --standalone`` agent per host (worker hosts first, then dedicated server hosts), the
job's store in a process of its own (``gradfleet store``, ``GRADFLEET_STORE=own``) on one more
host that trains nothing, every host in a network namespace with its link shaped by
``tc tbf`` (:mod:`benchmarks.cluster.netcluster`).  The workload is the cluster benchmark's MLP
(``mlp_workload.py``).  Once the run's ``metrics.jsonl`` shows update ``--kill-at``, the victim
host is lost: every process inside its namespace (agent and worker) is SIGKILLed -- or, for
``allreduce``, only its worker process, which its agent restarts (``--max-restarts=1``) so that
the rejoin from a live peer is timed too.

Per case: whether every surviving agent exited 0, the last update logged, whether every update
1..``--steps`` was logged exactly once, the R each update took summed against the gradients the
chief accepted (each update takes R, so a gradient counted twice or lost shows), what
``summary.json`` names as lost, the longest time between two consecutive updates (the writing
rank's clock; across a change of writer, both clocks start at the job's start barrier) against
the median one, and for the restarted worker the seconds from its process start to its first
update's record.

The optional comparison rows (``--only torchft,torchft-fast,ddp``) train the same MLP on the
same hosts without gradfleet (:mod:`benchmarks.cluster.torchft_worker`): torchft's
fault-tolerant DDP (``pip install torchft-nightly``; its release 0.2.0 does not survive a
peer's death), whose Lighthouse runs on the store's host, with the same process kill and
restart as ``allreduce``; and plain DDP under the same kill, which ends the job.

Writes ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cluster.cluster_report import machine  # noqa: E402
from benchmarks.cluster.netcluster import (  # noqa: E402
    TORCHRUN,
    Cluster,
    stop,
    unavailable_reason,
)

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).with_name("mlp_workload.py")
COMPARISON = Path(__file__).with_name("torchft_worker.py")
LIGHTHOUSE = str(Path(sys.executable).with_name("torchft_lighthouse"))  # torchft's, beside python


@dataclass(frozen=True)
class Case:
    label: str
    strategy: str
    servers: int  # dedicated server hosts, after the workers
    victim: str  # "rank:K" (a worker or server rank), by role
    whole_host: bool = True  # False: only the worker process dies; its agent restarts it
    restarts: int = 0  # the victim's agent's --max-restarts
    engine: str = "gradfleet"  # or "torchft", "ddp": the comparison rows (torchft_worker.py)
    heartbeat_ms: int = 5000  # torchft: the Lighthouse's heartbeat timeout
    collective_s: float = 5.0  # torchft: its gloo group's timeout (its train_ddp.py's: 5 s)


def cases(n: int) -> dict[str, Case]:
    r = n - 1
    return {
        "chief": Case(
            f"SyncReplicas R={r} of {n}, the chief on rank 0's host (its standby on another "
            "worker), rank 0's host lost",
            f"sync-replicas:replicas_to_aggregate={r},transport=server", 0, "0",
        ),
        "shard": Case(
            f"SyncReplicas R={r} of {n}, {n} shards over the workers, a standby per shard, "
            "shard 1's host lost",
            f"sync-replicas:replicas_to_aggregate={r},shards={n},standby=true", 0, "1",
        ),
        "dedicated": Case(
            f"SyncReplicas R={r} of {n}, the chief on a dedicated server host (its standby on "
            "a worker), the server's host lost",
            f"sync-replicas:replicas_to_aggregate={r}", 1, str(n),
        ),
        "allreduce": Case(
            f"SyncReplicas R={n} of {n} on the all-reduce, max_losses=1, rank 2's process "
            "killed and restarted by its agent",
            f"sync-replicas:replicas_to_aggregate={n},max_losses=1", 0, "2",
            whole_host=False, restarts=1,
        ),
        "easgd": Case(
            "asynchronous EASGD, period 4, the centre on a dedicated server host (its standby "
            "on a worker), the centre's host lost",
            "easgd:mode=async,period=4", 1, str(n),
        ),
        "torchft": Case(
            f"torchft's fault-tolerant DDP, {n} replica groups of one process, the Lighthouse "
            "on the store's host, its defaults (heartbeat timeout 5 s, gloo timeout 5 s), "
            "rank 2's process killed and restarted",
            "-", 0, "2", whole_host=False, restarts=1, engine="torchft",
        ),
        "torchft-fast": Case(
            f"torchft's fault-tolerant DDP, {n} replica groups, heartbeat timeout 1 s, gloo "
            "timeout 2 s, rank 2's process killed and restarted",
            "-", 0, "2", whole_host=False, restarts=1, engine="torchft", heartbeat_ms=1000,
            collective_s=2.0,
        ),
        "ddp": Case(
            f"torch DDP, gloo, {n} ranks, rank 2's process killed (nothing restarts it)",
            "-", 0, "2", whole_host=False, engine="ddp", collective_s=30.0,
        ),
    }  # fmt: skip


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # whole lines only: the writer may be mid-line
    return [json.loads(line) for line in lines if line.strip()]


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def started_at(pid: int) -> float:
    """The process's start, in seconds of uptime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def wait_for_update(
    out: Path, procs: list[subprocess.Popen], update: int, deadline: float
) -> list[int]:
    """The updates logged once ``update`` is (or a process ended, or time ran out)."""
    made: list[int] = []
    while time.monotonic() < deadline:
        made = [r["step"] for r in metrics(out) if "loss" in r]
        if (made and made[-1] >= update) or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    return made


def watch_to_the_end(
    pid_file: Path,
    old_pid: int | None,
    restarted: bool,
    survivors: list[subprocess.Popen],
    deadline: float,
) -> float | None:
    """Wait for every survivor to end; with ``restarted``, the seconds from the victim's new
    process start to its pid file (written once it trains again, after its heal)."""
    rejoin = None
    while time.monotonic() < deadline:
        if restarted and rejoin is None and pid_file.is_file():
            pid = int(pid_file.read_text())
            if pid != old_pid:
                rejoin = round(uptime() - started_at(pid), 2)
        if all(p.poll() is not None for p in survivors):
            break
        time.sleep(0.05)
    return rejoin


def run_case(cluster: Cluster, key: str, case: Case, args: argparse.Namespace) -> dict:
    if case.engine != "gradfleet":
        return run_comparison(cluster, key, case, args)
    n, world = args.hosts, args.hosts + case.servers
    store_host = world  # the last namespace: the store, nothing else
    port = 29000 + (os.getpid() + int(time.time())) % 500
    victim = int(case.victim)
    with tempfile.TemporaryDirectory(prefix="gff-") as tmp:
        tmp_path = Path(tmp)
        out = tmp_path / "run"
        store = cluster.popen(
            store_host, [sys.executable, "-m", "gradfleet", "store", "--port", str(port)],
            cwd=ROOT, log=tmp_path / "store.log",
        )  # fmt: skip
        time.sleep(2.0)
        train = ["-m", "gradfleet", "train", "--workload", str(WORKLOAD), "-s", case.strategy,
                 "-n", str(n), "--steps", str(args.steps), "--timeout", str(args.timeout),
                 "--out", str(out), "-q"]  # fmt: skip
        if case.servers:
            train += ["--servers", str(case.servers)]
        agents = []
        for h in range(world):
            restarts = case.restarts if h == victim else 0
            env = {
                "GRADFLEET_STORE": "own", "GRADFLEET_RANK": str(h),
                "GRADFLEET_WORLD_SIZE": str(world),
                "GRADFLEET_MASTER_ADDR": cluster.hosts[store_host].address,
                "GRADFLEET_MASTER_PORT": str(port),
                "GRADFLEET_SERVER_HOST": cluster.hosts[h].address,
                "GF_MLP_PARAMS": str(args.params), "GF_MLP_DEVICE_TIME": str(args.device_time),
                "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            agent = [*TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=1",
                     "--monitor-interval=0.2", f"--max-restarts={restarts}"]  # fmt: skip
            agents.append(cluster.popen(h, [*agent, *train], cwd=ROOT, env=env,
                                        log=tmp_path / f"host{h}.log"))  # fmt: skip
        result: dict = {"case": key, **asdict(case)}
        deadline = time.monotonic() + args.deadline
        try:
            made = wait_for_update(out, agents, args.kill_at, deadline)
            pid_file = out / "pids" / f"rank-{victim}.pid"
            old_pid = int(pid_file.read_text()) if pid_file.is_file() else None
            if case.whole_host:
                cluster.kill_host(victim)
            elif old_pid is not None:
                os.kill(old_pid, 9)
            result["killed_at_update"] = made[-1] if made else None
            survivors = [a for h, a in enumerate(agents) if h != victim or not case.whole_host]
            result["rejoin_s"] = watch_to_the_end(
                pid_file, old_pid, not case.whole_host, survivors, deadline
            )
            result["exit_codes"] = {h: a.poll() for h, a in enumerate(agents)}
        finally:
            stop([*agents, store])
        records = metrics(out)
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        result["logs"] = {h: _tail(tmp_path / f"host{h}.log") for h in range(world)}
    result.update(judge(records, summary, case, args, victim))
    return result


def run_comparison(cluster: Cluster, key: str, case: Case, args: argparse.Namespace) -> dict:
    """A comparison row: torchft's fault-tolerant DDP or plain DDP (``torchft_worker.py``), one
    process per worker host started directly (no agent), the same kill; a torchft replica is
    started again 0.2 s after it died (as an agent's ``--monitor-interval`` would), to heal from
    a live peer."""
    n = args.hosts
    port = 29000 + (os.getpid() + int(time.time())) % 500
    victim = int(case.victim)
    addresses = ",".join(cluster.hosts[h].address for h in range(n))
    lighthouse_addr = f"{cluster.hosts[n].address}:29510"
    with tempfile.TemporaryDirectory(prefix="gff-") as tmp:
        tmp_path = Path(tmp)
        out = tmp_path / "run"
        out.mkdir()
        helpers = []
        if case.engine == "torchft":
            helpers.append(cluster.popen(
                n, [LIGHTHOUSE, "--min_replicas", "1", "--bind", lighthouse_addr,
                    "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                    "--heartbeat_timeout_ms", str(case.heartbeat_ms)],
                cwd=ROOT, log=tmp_path / "lighthouse.log",
            ))  # fmt: skip
            time.sleep(1.0)

        def start(h: int, rejoin: bool = False) -> subprocess.Popen:
            cmd = [sys.executable, str(COMPARISON), "--mode", case.engine, "--rank", str(h),
                   "--world", str(n), "--addresses", addresses, "--port", str(port),
                   "--lighthouse", f"http://{lighthouse_addr}", "--out", str(out),
                   "--params", str(args.params), "--device-time", str(args.device_time),
                   "--steps", str(args.steps), "--deadline", str(args.deadline),
                   "--timeout", str(case.collective_s)]  # fmt: skip
            if rejoin:
                cmd.append("--rejoin")
            if case.engine == "torchft":
                # torchft advertises stores at socket.gethostname(), which names the machine,
                # not the emulated host: give the process a hostname of its own, its address
                address = cluster.hosts[h].address
                cmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', address,
                       *cmd]  # fmt: skip
            log = tmp_path / f"host{h}{'-again' if rejoin else ''}.log"
            return cluster.popen(h, cmd, cwd=ROOT, env={"OMP_NUM_THREADS": "1"}, log=log)

        workers = [start(h) for h in range(n)]
        result: dict = {"case": key, **asdict(case)}
        deadline = time.monotonic() + args.deadline
        again = None
        try:
            made = wait_for_update(out, workers, args.kill_at, deadline)
            pid_file = out / "pids" / f"rank-{victim}.pid"
            old_pid = int(pid_file.read_text()) if pid_file.is_file() else None
            if old_pid is not None:
                os.kill(old_pid, 9)
            result["killed_at_update"] = made[-1] if made else None
            if case.restarts:
                time.sleep(0.2)
                again = start(victim, rejoin=True)
            survivors = [w for h, w in enumerate(workers) if h != victim]
            survivors += [again] if again is not None else []
            result["rejoin_s"] = watch_to_the_end(
                pid_file, old_pid, again is not None, survivors, deadline
            )
            codes = {h: w.poll() for h, w in enumerate(workers)}
            if again is not None:
                codes[victim] = again.poll()
            result["exit_codes"] = codes
        finally:
            stop([*workers, *([again] if again is not None else []), *helpers])
        result["logs"] = {log.stem: _tail(log) for log in sorted(tmp_path.glob("*.log"))}
        if args.keep_logs is not None:
            kept = args.keep_logs / key
            kept.mkdir(parents=True, exist_ok=True)
            for log in tmp_path.glob("*.log"):
                shutil.copy(log, kept / log.name)
        records = metrics(out)
    result.update(judge(records, {}, case, args, victim))
    return result


def _tail(log: Path, chars: int = 6000) -> str:
    """The end of a host's console, without torch's C++ stack frames."""
    lines = log.read_text(errors="replace").splitlines()
    return "\n".join(x for x in lines if not x.startswith("frame #"))[-chars:]


def judge(records: list[dict], summary: dict, case: Case, args: argparse.Namespace,
          victim: int) -> dict:  # fmt: skip
    """The case's figures from the run's files."""
    updates = [r for r in records if "loss" in r]
    steps = [r["step"] for r in updates]
    walls = sorted({r["step"]: r["wall"] for r in updates}.items())
    gaps = [(b - a, s) for (_, a), (s, b) in zip(walls, walls[1:], strict=False)]
    out: dict = {
        "last_update": max(steps, default=None),
        "every_update_once": sorted(steps) == list(range(1, args.steps + 1)),
        "longest_gap_s": round(max(gaps)[0], 2) if gaps else None,
        "longest_gap_before_update": max(gaps)[1] if gaps else None,
        "median_gap_s": round(statistics.median(g for g, _ in gaps), 2) if gaps else None,
        "lost_named": [w.get("rank") for w in summary.get("lost_workers", [])],
        "rejoined": [r.get("rank") for r in records if r.get("event") == "worker_rejoined"],
    }
    replicas, accepted = summary.get("replicas"), summary.get("gradients_per_worker")
    if replicas is not None and accepted is not None:
        out["gradients_applied"] = sum(replicas)
        out["gradients_accepted"] = sum(c["accepted"] for c in accepted.values())
    return out


def table(results: list[dict]) -> str:
    head = ("| case | lost | survivors exit 0 | last update | each update logged once | "
            "R summed = accepted | named lost | longest gap s (before update) | median gap s | "
            "restarted: start to training s |")  # fmt: skip
    rows = [head, "|" + "---|" * 10]
    for r in results:
        victim = f"rank {r['victim']}" + (" (process)" if not r["whole_host"] else " (host)")
        codes = r.get("exit_codes", {})
        alive = [c for h, c in codes.items() if int(h) != int(r["victim"]) or not r["whole_host"]]
        sums = ("-" if "gradients_applied" not in r else
                f"{r['gradients_applied']} = {r['gradients_accepted']}")  # fmt: skip
        ok = "yes" if alive and all(c == 0 for c in alive) else codes
        rows.append(
            f"| {r['label']} | {victim} | {ok} "
            f"| {r.get('last_update')} | {'yes' if r.get('every_update_once') else 'no'} | {sums} "
            f"| {r.get('lost_named') or '-'} | {r.get('longest_gap_s')} "
            f"({r.get('longest_gap_before_update')}) | {r.get('median_gap_s')} "
            f"| {r.get('rejoin_s') if r.get('rejoin_s') is not None else '-'} |"
        )  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4, help="worker hosts")
    p.add_argument("--link", default="200mbit")
    p.add_argument("--params", type=float, default=1e6)
    p.add_argument("--device-time", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--timeout", type=float, default=60.0, help="the job's --timeout")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds per case")
    p.add_argument("--only", default=",".join(k for k, c in cases(4).items()
                                              if c.engine == "gradfleet"),
                   help="cases, comma-separated; besides the default ones: torchft, torchft-fast "
                   "(needs the torchft-nightly package), ddp")  # fmt: skip
    p.add_argument("--name", default="failover")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy each comparison case's "
                   "console logs to DIR/<case>/")  # fmt: skip
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    known = cases(args.hosts)
    chosen = args.only.split(",")
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; allowed: {', '.join(known)}")
    if not 0 < args.kill_at < args.steps:
        raise SystemExit(f"--kill-at must be in 1..{args.steps - 1}, got {args.kill_at}")
    if any(known[c].engine == "torchft" for c in chosen) and not shutil.which(LIGHTHOUSE):
        raise SystemExit(
            "--only torchft: torchft is not installed here (its Lighthouse, "
            f"{LIGHTHOUSE}, is missing): pip install torchft-nightly"
        )
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"no emulated cluster here: {reason}")
    load = os.getloadavg()[0]
    started = time.monotonic()
    results = []
    for key in chosen:
        case = known[key]
        hosts = args.hosts + case.servers + 1  # and the store's
        with Cluster(hosts, args.link) as cluster:
            result = run_case(cluster, key, case, args)
        print(json.dumps({k: v for k, v in result.items() if k != "logs"}), flush=True)
        results.append(result)
    command = "python benchmarks/cluster/failover.py " + " ".join(argv or sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine(), "command": command, "load_before": load,
              "args": {k: str(v) for k, v in vars(args).items()}, "results": results}  # fmt: skip
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    text = (
        f"Machine: {machine()}. Load average before the run: {load:.2f}.\n"
        f"Command: `{command.strip()}` ({(time.monotonic() - started) / 60:.1f} min).\n"
        f"Workload: MLP of {args.params:g} parameters, batch 32 per worker, Adam; "
        f"{args.hosts} worker hosts, links {args.link}, {args.steps} updates, the loss after "
        f"update {args.kill_at}; the job's store on a host of its own.\n\n{table(results)}\n"
    )
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
