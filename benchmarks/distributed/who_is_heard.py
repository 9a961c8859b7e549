"""Who is heard with backups and no server (``transport="allreduce"``, R = N - 1), gloo ranks on
loopback: every rank computes for the same ``--compute-ms`` per step, and the last rank
``--slow-ms`` more for the first ``--slow-until`` updates.  From the exchange's record of each
update's members: how many of the 10 updates after the slowdown ended took the recovered rank
(against the others' average), and each rank's share of the updates after those, divided by
its fair share R / N.

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


def worker(ctx: RankContext, args: argparse.Namespace) -> list[list[int]]:
    n = ctx.world_size
    model = torch.nn.Linear(64, 64)
    opt = SyncReplicasOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), n - 1, n, transport="allreduce",
        last_step=args.updates,
    )  # fmt: skip
    while opt.global_step < args.updates:
        model.zero_grad()
        model(torch.randn(32, 64)).pow(2).mean().backward()
        slow = ctx.rank == n - 1 and opt.global_step < args.slow_until
        time.sleep((args.compute_ms + (args.slow_ms if slow else 0)) / 1000)
        opt.step()
    history = opt.exchange.history
    opt.close()
    dist.barrier()
    return history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--updates", type=int, default=120)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--slow-ms", type=float, default=60.0)
    p.add_argument("--slow-until", type=int, default=20)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    n, r = args.ranks, args.ranks - 1
    for run in range(args.runs):
        history = run_ranks(worker, n, args=(args,), timeout=600)[0]
        after = history[args.slow_until : args.slow_until + 10]
        rest = history[args.slow_until + 10 :]
        others = sum(sum(k in m for m in after) for k in range(n - 1)) / (n - 1)
        shares = {k: sum(k in m for m in rest) / len(rest) / (r / n) for k in range(n)}
        print(
            f"run {run}: rank {n - 1} in {sum(n - 1 in m for m in after)} of the 10 updates "
            f"after its slowdown (the others: {others:.1f}); share / (R/N) over the next "
            f"{len(rest)}: " + ", ".join(f"{k}: {v:.2f}" for k, v in shares.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
