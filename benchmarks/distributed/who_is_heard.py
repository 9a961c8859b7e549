"""Who is heard with backups and no server (``transport="allreduce"``, R = N - 1), gloo ranks on
loopback: every rank computes for ``--compute-ms`` per step, and the last rank ``--slow-ms``
more for the first ``--slow-until`` updates (``--throughout``: for the whole run).  Each run
trains twice, with ``hear_every_worker`` on (the default) and off, and prints for each: how
many of the 10 updates after the slowdown ended took the recovered rank (against the others'
average), each rank's share of the updates after those (the last 50 of them, or all after the
first 20 with ``--throughout``) divided by its fair share R / N, updates per second, and the
seconds each rank spent waiting for another.

    python -m benchmarks.distributed.who_is_heard [--ranks 4] [--updates 120] [--runs 2]

Results: benchmarks/results/who-is-heard/.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext, run_ranks


def worker(
    ctx: RankContext, args: argparse.Namespace, hear: bool
) -> tuple[list[list[int]], float, float]:
    n = ctx.world_size
    model = torch.nn.Linear(64, 64)
    opt = SyncReplicasOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), n - 1, n, transport="allreduce",
        last_step=args.updates, hear_every_worker=hear,
    )  # fmt: skip
    slow_until = args.updates if args.throughout else args.slow_until
    started = time.monotonic()
    while opt.global_step < args.updates:
        model.zero_grad()
        model(torch.randn(32, 64)).pow(2).mean().backward()
        slow = ctx.rank == n - 1 and opt.global_step < slow_until
        time.sleep((args.compute_ms + (args.slow_ms if slow else 0)) / 1000)
        opt.step()
    took = time.monotonic() - started
    history, waited = opt.exchange.history, opt.exchange.deference.waited
    opt.close()
    dist.barrier()
    return history, took, waited


def report(args: argparse.Namespace, results: list) -> str:
    n, r = args.ranks, args.ranks - 1
    history, took = results[0][0], max(took for _, took, _ in results)
    waited = ", ".join(f"{w:.2f}" for _, _, w in results)
    if args.throughout:
        said, rest = "", history[20:]
    else:
        after = history[args.slow_until + 1 : args.slow_until + 11]
        others = sum(sum(k in m for m in after) for k in range(n - 1)) / (n - 1)
        said = (
            f"rank {n - 1} in {sum(n - 1 in m for m in after)} of the 10 updates after its "
            f"slowdown (the others: {others:.1f}); "
        )
        rest = history[-50:]
    shares = ", ".join(
        f"{k}: {sum(k in m for m in rest) / len(rest) / (r / n):.2f}" for k in range(n)
    )
    return (
        f"{said}share / (R/N) over {len(rest)} updates: {shares}; "
        f"{args.updates / took:.1f} updates/s; seconds waiting per rank: {waited}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--updates", type=int, default=120)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--slow-ms", type=float, default=60.0)
    p.add_argument("--slow-until", type=int, default=20)
    p.add_argument("--throughout", action="store_true", help="the last rank is slow throughout")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    for run in range(args.runs):
        for hear in (True, False):
            results = run_ranks(worker, args.ranks, args=(args, hear), timeout=600)
            print(f"run {run}, hear_every_worker={hear}: {report(args, results)}", flush=True)


if __name__ == "__main__":
    main()
