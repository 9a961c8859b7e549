"""The exchange without a server with a loss allowed (``max_losses=1``), 3 gloo ranks on
loopback: the all-reduce (R = N = 3), or with ``--replicas 2`` backup workers (R = 2 of 3,
where one loss is allowed by default):

* ``cost``: updates per second with and without losses allowed and no failure (medians after
  warm-up, the two alternated ``--rounds`` times);
* ``loss``: rank ``--kill`` (2; 0 is the rank that would host a server) SIGKILLed after update
  20 -- the job's store lives in a fourth process, as a launcher hosts it: the longest gap
  between two updates on a survivor, and a restarted worker of that rank -- the seconds from
  its code's start (the harness forks it with torch imported) to its first update made with
  the others (healed from a live member, no file read) -- then its equality with the
  survivor;
* ``hang`` (R = N only): rank 2 stops itself (SIGSTOP: alive, its sockets open) after update
  20; rank 0 lets it go on (SIGCONT) 10 updates later: the longest gap on rank 0, the seconds
  from the SIGCONT to the end of rank 2's first step() after it (it rejoins and heals), and
  its equality with rank 0.

    python -m benchmarks.distributed.elastic_allreduce [--params 2000000] [--rounds 3]
    python -m benchmarks.distributed.elastic_allreduce --replicas 2 --kill 0

Results: benchmarks/results/elastic-allreduce/ (docs/failures.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext, free_port, run_ranks

N = 3
WARMUP, MEASURED = 10, 60
KILL_AT = 20


def _model(params: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = int((params / 2) ** 0.5)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    width = model[0].in_features
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, width, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def cost_rank(ctx: RankContext, params: int, replicas: int, losses: int) -> float:
    model = _model(params)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = SyncReplicasOptimizer(sgd, replicas, N, max_losses=losses)
    times = []
    for step in range(WARMUP + MEASURED):
        start = time.perf_counter()
        _train_step(model, opt, ctx.rank, step)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    opt.close()
    return statistics.median(times)


def loss_rank(ctx: RankContext, params: int, port: int, replicas: int, killed: int) -> dict:
    """Ranks 0..N-1 train; rank ``killed`` dies after update KILL_AT.  Rank N hosts the job's
    store from the start (as a launcher does) and, once told, restarts the killed worker."""
    entered = time.time()
    joiner = ctx.rank == N
    me = killed if joiner else ctx.rank
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=joiner, wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    if joiner:
        store.wait(["bench/alone"], timedelta(seconds=120))
        entered = time.time()  # the restart: from here
    else:
        dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    model = _model(params)
    extra = {"worker": killed, "store": store} if joiner else {}
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = SyncReplicasOptimizer(sgd, replicas, N, max_losses=1, timeout=60, **extra)
    watcher = min(r for r in range(N) if r != killed)
    stamps: list[tuple[int, float]] = []
    end = None
    while end is None or opt.global_step < end:
        _train_step(model, opt, me, opt.local_step)
        stamps.append((opt.global_step, time.time()))
        if me == killed and not joiner and opt.global_step >= KILL_AT:
            ctx.signal("die")
            time.sleep(120)
        if me == watcher and opt.global_step == KILL_AT + 10:
            store.set("bench/alone", "1")
        joins = [c for c in opt.membership_changes if c["event"] == "joined"]
        if end is None and (joins or joiner):
            end = (joins[0]["global_step"] if joins else opt.exchange.start_step) + 20
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    opt.close()
    return {"entered": entered, "stamps": stamps, "digest": digest,
            "changes": opt.membership_changes}  # fmt: skip


def hang_rank(ctx: RankContext, params: int, port: int) -> dict:
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=ctx.rank == 0, wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    model = _model(params)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = SyncReplicasOptimizer(sgd, N, N, max_losses=1, timeout=60)
    stamps: list[tuple[int, float]] = []
    end, resumed = None, None
    while end is None or opt.global_step < end:
        _train_step(model, opt, ctx.rank, opt.local_step)
        stamps.append((opt.global_step, time.time()))
        if ctx.rank == 2 and len(stamps) == KILL_AT:
            store.set("bench/stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            resumed = float(store.get("bench/continued"))
        if ctx.rank == 0 and opt.global_step == KILL_AT + 10:
            os.kill(int(store.get("bench/stopped")), signal.SIGCONT)
            store.set("bench/continued", repr(time.time()))
        joins = [c for c in opt.membership_changes if c["event"] == "joined"]
        if end is None and (joins or (ctx.rank == 2 and len(stamps) > KILL_AT)):
            end = opt.global_step + 20
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    opt.close()
    return {"stamps": stamps, "digest": digest, "resumed": resumed,
            "changes": opt.membership_changes}  # fmt: skip


def _gaps(stamps: list[tuple[int, float]]) -> tuple[float, float]:
    """The longest gap between two updates, and the steady one (median before update KILL_AT).
    A step() that made no update (a backup's gradient came late) ends no gap."""
    times, last = [], None
    for step, t in stamps:
        if step != last:
            times.append(t)
            last = step
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(gaps), statistics.median(gaps[: KILL_AT - 1])


def _changes(out: dict) -> str:
    return json.dumps(
        [{k: c[k] for k in ("event", "ranks", "global_step", "seconds")} for c in out["changes"]]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=N, help="R (N: the all-reduce)")
    parser.add_argument("--kill", type=int, default=2, help="the rank killed and restarted")
    args = parser.parse_args()
    R, killed = args.replicas, args.kill
    watcher = min(r for r in range(N) if r != killed)
    plain = "max_losses=0" if R < N else "default"  # backups allow N - R losses by default
    medians: dict[str, list[float]] = {plain: [], "max_losses=1": []}
    for _ in range(args.rounds):
        for name, losses in ((plain, 0), ("max_losses=1", 1)):
            out = run_ranks(cost_rank, N, args=(args.params, R, losses), timeout=300)
            medians[name].append(max(out))  # the slowest rank sets the pace
    step = {k: statistics.median(v) for k, v in medians.items()}
    print(f"params {args.params}, R = {R} of {N} gloo ranks on loopback, torch {torch.__version__}")
    for name, s in step.items():
        print(f"  {name:13s} median step {s * 1e3:7.1f} ms  ({1 / s:6.1f} steps/s)")
    print(f"  cost of max_losses=1: {step['max_losses=1'] / step[plain]:.3f}x step time")
    out = run_ranks(
        loss_rank, N + 1, args=(args.params, free_port(), R, killed), timeout=300,
        init_process_group=False, kill_on={killed: "die"},
    )  # fmt: skip
    survivor, back = out[watcher], out[N]
    longest, steady = _gaps(survivor["stamps"])
    first = next(t for s, t in back["stamps"])
    print(f"  loss of rank {killed} (kill -9 after update {KILL_AT}):")
    print(f"    longest gap between updates on rank {watcher}: {longest:.2f} s "
          f"(steady {steady * 1e3:.0f} ms)")  # fmt: skip
    print(
        f"    restarted rank {killed}: first update {first - back['entered']:.2f} s after its "
        "code starts"
    )
    print(f"    rank {watcher} and rank {killed} equal at the end: "
          f"{survivor['digest'] == back['digest']}")  # fmt: skip
    print(f"    rank {watcher}'s changes: " + _changes(survivor))
    if R < N:
        return
    out = run_ranks(
        hang_rank, N, args=(args.params, free_port()), timeout=300, init_process_group=False
    )
    zero, back = out[0], out[2]
    longest, steady = _gaps(zero["stamps"])
    first = back["stamps"][KILL_AT][1]  # its first step() after SIGCONT: rejoined and healed
    print(f"  rank 2 stopped (SIGSTOP after update {KILL_AT}, SIGCONT 10 updates later):")
    print(f"    longest gap between updates on rank 0: {longest:.2f} s "
          f"(steady {steady * 1e3:.0f} ms)")  # fmt: skip
    print(f"    rank 2: rejoined and healed {first - back['resumed']:.2f} s after SIGCONT")
    print(f"    rank 0 and rank 2 equal at the end: {zero['digest'] == back['digest']}")
    print("    rank 0's changes: " + _changes(zero))


if __name__ == "__main__":
    main()
