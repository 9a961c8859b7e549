"""Rank functions for backup workers without a server (run by ``run_ranks``).

Each gradient is a function of (rank, the step it was computed at, the variables), so a
float64 replay knows every update from the members that made it, as the leaders announced
them on the store."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext

N, R = 3, 2
ROTATE = 6  # steps 0..ROTATE-1: rank step % N is slow, the other two make the update
LAST = 24  # last_step
NAN_AT = 3  # rank 1's first gradient at this step is NaN: it raises, then sends a finite one
LR = 0.05
SLOW_S = 0.3


def gradient(rank: int, step: int, w: torch.Tensor) -> torch.Tensor:
    """What rank ``rank`` computes at ``step`` (float64)."""
    k = torch.arange(w.numel(), dtype=torch.float64)
    return 0.3 * w + torch.sin(k * (rank + 1) + 0.1 * step)


def start_w() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)


def backups(ctx: RankContext) -> dict:
    """R = 2 of N = 3 with ``transport="allreduce"`` until LAST: first a slow rank that moves
    from step to step, then none; rank 1 meets a NaN once.  Returns the variables, each
    step() call's outcome, the counters, the NaN's verdict and (rank 0) every update's
    members."""
    w = torch.nn.Parameter(start_w())
    opt = SyncReplicasOptimizer(
        torch.optim.Adam([w], lr=LR), R, N, transport="allreduce", last_step=LAST, timeout=60
    )
    calls: list[tuple[int, bool, int]] = []  # (step computed at, accepted, global step after)
    nan = None
    while opt.global_step < LAST:
        step = opt.local_step
        if ctx.rank == 1 and step == NAN_AT and nan is None:
            w.grad = torch.full_like(w, float("nan"))
            before = w.detach().clone()
            try:
                opt.step()
                nan = "not raised"
            except FloatingPointError as exc:
                nan = {"error": str(exc), "unchanged": bool(torch.equal(w.detach(), before)),
                       "global_step": opt.global_step}  # fmt: skip
        w.grad = gradient(ctx.rank, step, w.detach())
        if step < ROTATE and step % N == ctx.rank:
            time.sleep(SLOW_S)
        opt.step()
        calls.append((step, bool(opt.last_gradient_accepted), opt.global_step))
    plan = None
    if ctx.rank == 0:
        board = opt.exchange.board
        plan = [list(board.wait_made(t).members) for t in range(LAST)]
    out = {
        "w": w.detach().tolist(),
        "calls": calls,
        "counters": {str(k): v for k, v in opt.worker_counters().items()},
        "history": opt.replicas_history(),
        "nan": nan,
        "plan": plan,
    }
    opt.close()
    dist.barrier()
    return json.loads(json.dumps(out))
