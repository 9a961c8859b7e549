"""What the emulated links can carry per step, with no optimizer and no protocol around it.

    python benchmarks/cluster/link_ceiling.py [--link 200mbit] [--params 10e6] [--steps 6]
                                      [--patterns allreduce,dedicated,over-workers]
                                      [--shards-per-server 4] [--out DIR] [--name NAME]

The cluster benchmark (``benchmarks/cluster/cluster.py``) compares whole training strategies.
This one moves only the bytes of one synchronous step of each, with torch.distributed's gloo
collectives and point-to-point calls, over the same namespaces and ``tc tbf`` links
(``netcluster``), so that a strategy's measured step can be set against the fastest step its
traffic allows here:

* ``allreduce``: the 4 workers all-reduce ``P`` float32 values in one call (gloo's ring: what
  DDP moves, without its buckets or the overlap with backward);
* ``dedicated``: each worker pushes its ``P`` values, cut into ``S`` equal shards, to 4 server
  hosts (``--shards-per-server`` each), in gradfleet's push order (``push_order``: the
  workers start on different servers), every request posted at once; a server sums a shard
  once all 4 pushes of it are in and sends the sum back to every worker (SyncReplicas on
  dedicated hosts, R = N, with read-ahead);
* ``over-workers``: the same with the shards served by the 4 workers themselves (a worker's
  own shards do not cross its link);
* ``dedicated-pushes``: ``dedicated``'s pushes alone, no sums sent back: each link carries one
  direction, so the pushes' own rate can be set against the rate they get while the sums flow
  the other way (its step ends when the last server host has all its pushes).

A step's time is the slowest worker's, from a barrier until all its sends and receives are
done; the figure is the median over ``--steps`` steps after one warm-up step.  "Pushes in" is
the time, from the same barrier, at which the last server had every push of its shards, and
"shard groups in" the same for each server's first shards, its second, and so on (the groups
the pushes go out in), so a group's pushes can be timed while the group before it is summed and
sent back.  Each host's bytes per step come from its interface counters, and the TCP segments
it sent and retransmitted from its namespace's ``/proc/net/snmp``.  Writes
``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cluster.netcluster import Cluster, rate_bits, stop, unavailable_reason, wait_all  # noqa: E402
from gradfleet.distributed.sync.worker.shard_clients import push_order  # noqa: E402

WORKERS = 4
PATTERNS = ("allreduce", "dedicated", "over-workers", "dedicated-pushes")


def servers_of(pattern: str) -> list[int]:
    """The ranks serving shards: 4 hosts after the workers, or the workers themselves."""
    dedicated = pattern.startswith("dedicated")
    return list(range(WORKERS, 2 * WORKERS)) if dedicated else list(range(WORKERS))


def _push_pull_step(
    torch, dist, rank: int, servers: list[int], shards: int, n: int, tag: int, pull: bool
) -> list[float]:
    """One step of the push/pull pattern on this rank (worker, server, or both), the sums sent
    back if ``pull``; returns when this rank had every push of each of its shards, in their
    order (empty: it serves none), in seconds from the call."""
    start = time.perf_counter()
    shards_in = []
    works = []
    mine = [k for k in range(shards) if servers[k % len(servers)] == rank]
    incoming = {k: [] for k in mine}
    for k in mine:  # a server's receives, posted first
        for w in range(WORKERS):
            if w != rank:
                buf = torch.empty(n)
                incoming[k].append((buf, dist.irecv(buf, src=w, tag=tag + k)))
    replies = []
    if rank < WORKERS:
        grad = torch.ones(n)
        for k in range(shards):
            if pull and servers[k % len(servers)] != rank:
                out = torch.empty(n)
                replies.append(dist.irecv(out, src=servers[k % len(servers)], tag=tag + shards + k))
        # gradfleet's own order: every server's first shard, then every server's second, the
        # servers rotated by the worker's number, so the workers start on different servers
        hosts = [servers[k % len(servers)] for k in range(shards)]
        for k in push_order(hosts, rank):
            if servers[k % len(servers)] != rank:
                works.append(dist.isend(grad, dst=servers[k % len(servers)], tag=tag + k))
    for k in mine:  # shards complete roughly in their order: answer each once it is whole
        total = torch.ones(n) if rank < WORKERS else torch.zeros(n)
        for buf, work in incoming[k]:
            work.wait()
            total += buf
        shards_in.append(time.perf_counter() - start)
        if pull:
            works += [
                dist.isend(total, dst=w, tag=tag + shards + k) for w in range(WORKERS) if w != rank
            ]
    for work in works + replies:
        work.wait()
    return shards_in


def rank_main() -> None:
    """One rank under torchrun (``GF_CEILING``: the JSON of pattern, params, steps, shards)."""
    import torch
    import torch.distributed as dist

    cfg = json.loads(os.environ["GF_CEILING"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pattern, steps = cfg["pattern"], cfg["steps"] + 1  # the first is a warm-up
    servers = servers_of(pattern)
    shards = cfg["shards_per_server"] * len(servers)
    n = int(cfg["params"]) // shards
    group = dist.new_group(list(range(WORKERS)))
    x = torch.ones(n * shards)
    times, shards_in = [], []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        if pattern == "allreduce":
            if rank < WORKERS:
                dist.all_reduce(x, group=group)
        else:
            pull = pattern != "dedicated-pushes"
            tag = step * 4 * shards
            shards_in.append(_push_pull_step(torch, dist, rank, servers, shards, n, tag, pull))
        times.append(time.perf_counter() - start)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times[1:], shards_in[1:]))
    if rank == 0:
        # a worker's sends end when the kernel has the bytes: without sums to wait for, the
        # step ends at the servers' last receive
        timed = gathered if pattern == "dedicated-pushes" else gathered[:WORKERS]
        steps_s = [max(t) for t in zip(*(g[0] for g in timed), strict=True)]
        # a server's j-th shard is in group j (every server's first shards go out first):
        # per step, the time the last server had its shards of each group
        served = [g[1] for r, g in enumerate(gathered) if r in servers]
        groups = [[max(g) for g in zip(*per_server, strict=True)]
                  for per_server in zip(*served, strict=True)]  # fmt: skip
        out = {"steps_s": steps_s, "groups_in_s": groups, "elements": n * shards,
               "pushes_in_s": [g[-1] for g in groups]}  # fmt: skip
        Path(cfg["result"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def measure(pattern: str, args, workdir: Path) -> dict:
    """Run ``pattern`` on a fresh cluster; the step times and each host's bytes per step."""
    hosts = len(set(range(WORKERS)) | set(servers_of(pattern)))
    result = workdir / f"{pattern}.json"
    cfg = {"pattern": pattern, "params": args.params, "steps": args.steps, "result": str(result),
           "shards_per_server": args.shards_per_server}  # fmt: skip
    env = {"GF_CEILING": json.dumps(cfg), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with Cluster(hosts, args.link) as cluster:
        before, tcp_before = cluster.counters(), cluster.tcp_counters()
        procs = cluster.torchrun(
            [__file__, "--rank"], cwd=workdir, port=29533, static=True, logs=workdir,
            env_per_host={h: env for h in range(hosts)},
        )  # fmt: skip
        codes = wait_all(procs, time.monotonic() + args.deadline)
        if codes is None:
            stop(procs)
        after, tcp_after = cluster.counters(), cluster.tcp_counters()
    if codes != [0] * hosts:
        logs = "\n".join((workdir / f"host{h}.log").read_text()[-2000:] for h in range(hosts))
        raise RuntimeError(f"{pattern}: ranks ended {codes}\n{logs}")
    out = json.loads(result.read_text())
    per_step = args.steps + 1
    out["bytes_per_step"] = {
        h: ((after[h][0] - before[h][0]) / per_step, (after[h][1] - before[h][1]) / per_step)
        for h in after
    }
    out["tcp_segments"] = {  # per host, the whole run: (sent, retransmitted)
        h: (tcp_after[h][0] - tcp_before[h][0], tcp_after[h][1] - tcp_before[h][1])
        for h in tcp_after
    }
    out["median_s"] = statistics.median(out["steps_s"])
    ins = out["pushes_in_s"]
    out["pushes_in_median_s"] = statistics.median(ins) if ins else None
    groups = out["groups_in_s"]
    out["groups_in_median_s"] = [statistics.median(g) for g in zip(*groups)] if groups else []
    return out


def report(results: dict, args) -> str:
    rate = rate_bits(args.link) / 8
    p = args.params * 4
    from benchmarks.cluster.cluster_report import machine

    lines = [
        f"Machine: {machine()}. Command: `python benchmarks/cluster/link_ceiling.py "
        f"{' '.join(sys.argv[1:])}`.",
        "",
        f"Links {args.link} ({rate / 1e6:.0f} MB/s), {args.params:.0e} float32 parameters "
        f"({p / 1e6:.0f} MB), {args.shards_per_server} shards per server, median of "
        f"{args.steps} steps.",
        "",
        "| pattern | step s (median) | steps s | x all-reduce | pushes in s (median) "
        "| shard groups in s (median) | busiest host MB per step, up / down "
        "| segments retransmitted, all hosts / most |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = results.get("allreduce", {}).get("median_s")
    for name, r in results.items():
        busiest = max(r["bytes_per_step"].values(), key=lambda b: max(b))
        ratio = f"{base / r['median_s']:.2f}" if base else "-"
        steps = ", ".join(f"{s:.2f}" for s in r["steps_s"])
        pushed = r.get("pushes_in_median_s")
        pushed = "-" if pushed is None else f"{pushed:.2f}"
        groups = ", ".join(f"{t:.2f}" for t in r["groups_in_median_s"]) or "-"
        segs = r["tcp_segments"].values()
        total = 100 * sum(b for _, b in segs) / max(sum(a for a, _ in segs), 1)
        most = max(100 * b / max(a, 1) for a, b in segs)
        lines.append(f"| {name} | {r['median_s']:.2f} | {steps} | {ratio} | {pushed} | {groups} "
                     f"| {busiest[0] / 1e6:.1f} / {busiest[1] / 1e6:.1f} "
                     f"| {total:.2f}% / {most:.2f}% |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="200mbit")
    parser.add_argument("--params", type=float, default=10e6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shards-per-server", type=int, default=4)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds per pattern")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="link-ceiling")
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main()
    patterns = args.patterns.split(",")
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown:
        parser.error(f"--patterns: unknown {unknown}; choose from {', '.join(PATTERNS)}")
    reason = unavailable_reason()
    if reason:
        sys.exit(f"link_ceiling: no emulated cluster here: {reason}")
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pattern in patterns:
            results[pattern] = measure(pattern, args, Path(tmp))
            print(f"{pattern}: {results[pattern]['median_s']:.2f} s per step", flush=True)
    text = report(results, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args) | {"out": str(args.out)}, "results": results}
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    (args.out / f"{args.name}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
