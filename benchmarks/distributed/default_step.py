"""The default exchange's cost per step against DDP: N gloo ranks on one host, the cluster
benchmark's MLP (Adam, batch 32), SyncReplicasOptimizer with R = N and no server named (the
all-reduce exchange; ``-ml``: with ``max_losses=1``) against ``DistributedDataParallel`` with
the same torch Adam.  Loopback links are fast, so what the exchange adds to each step --
collectives' fixed costs, checks, copies -- shows here that a network-bound cluster hides.

    python -m benchmarks.distributed.default_step [--params 1e6] [--world 4] [--rounds 2]

Per mode, the median step (zero_grad, forward, backward, step) after ``WARMUP`` steps, the
modes alternated ``--rounds`` times; the ratio is DDP's median over the mode's, each round
against DDP's median of the same round.  Results: benchmarks/results/default-step.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cluster.cluster_worker import Teacher, build_model  # noqa: E402
from gradfleet.distributed import SyncReplicasOptimizer  # noqa: E402
from gradfleet.distributed.testing import RankContext, run_ranks  # noqa: E402

WARMUP = 10
MODES = ("ddp", "default", "default-ml")


def _steps(ctx: RankContext, mode: str, params: float, steps: int) -> float:
    """This rank's median step in seconds."""
    torch.set_num_threads(1)  # the ranks share the host's cores
    model = build_model(params, 0)
    teacher = Teacher(0)
    inner = torch.optim.Adam(model.parameters(), lr=3e-4)
    if mode == "ddp":
        net, opt = nn.parallel.DistributedDataParallel(model), inner
    else:
        losses = {"max_losses": 1} if mode == "default-ml" else {}
        net = model
        opt = SyncReplicasOptimizer(inner, ctx.world_size, ctx.world_size, **losses)
    times = []
    for s in range(WARMUP + steps):
        started = time.perf_counter()
        x, y = teacher.batch(32, ctx.rank, s)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - started)
    if isinstance(opt, SyncReplicasOptimizer):
        opt.close()
    return statistics.median(times[WARMUP:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=1e6)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    medians: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            per_rank = run_ranks(
                _steps, args.world, args=(mode, args.params, args.steps), timeout=600
            )
            medians[mode].append(max(per_rank))  # the step is the slowest rank's
    print(
        f"{args.world} gloo ranks on one host, MLP of {args.params:.0e} parameters, Adam, "
        f"batch 32, torch {torch.__version__}; median step after {WARMUP} warm-up steps of "
        f"{args.steps}, {args.rounds} rounds\n"
    )
    print("| mode | median step ms, per round | DDP's median over the mode's, per round |")
    print("|---|---|---|")
    for mode in MODES:
        ms = ", ".join(f"{1e3 * m:.1f}" for m in medians[mode])
        ratio = ", ".join(f"{d / m:.2f}" for d, m in zip(medians["ddp"], medians[mode]))
        print(f"| {mode} | {ms} | {ratio} |")


if __name__ == "__main__":
    main()
