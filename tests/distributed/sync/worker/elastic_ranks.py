"""Rank functions for the all-reduce exchange with losses allowed (run by ``run_ranks``).

Processes 0-2 are the job's ranks 0-2; process 3 is rank 2 restarted.  Each gradient is a
function of (rank, the step it was computed at, the variables), so a float64 replay knows
every update from the members that made it."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext

N = 3
FIRST_LOSS = 6  # rank 2 dies after this update
ALONE = 3  # updates of ranks 0 and 1 before rank 2 is restarted
AFTER_JOIN = 4  # rank 1 dies this many updates after rank 2 came back
END_AFTER_JOIN = 8  # every rank stops this many updates after the join
LR = 0.05


def gradient(rank: int, step: int, w: torch.Tensor) -> torch.Tensor:
    """What rank ``rank`` computes at ``step`` (float64)."""
    k = torch.arange(w.numel(), dtype=torch.float64)
    return 0.3 * w + torch.sin(k * (rank + 1) + 0.1 * step)


def start_w() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 8, dtype=torch.float64)


def files_opened() -> list[str]:
    """From now on, the paths this process passes to ``torch.load`` (a live heal opens
    none)."""
    opened: list[str] = []
    real_load = torch.load

    def load(*args, **kwargs):
        if args and isinstance(args[0], (str, Path)):
            opened.append(str(args[0]))
        return real_load(*args, **kwargs)

    torch.load = load  # type: ignore[assignment]
    return opened


def _store(ctx: RankContext, port: int, joiner: bool) -> dist.Store:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=ctx.rank == 0 and not joiner, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip


def lose_and_rejoin(ctx: RankContext, port: int) -> dict:
    """Rank 2 is SIGKILLed after update FIRST_LOSS; the survivors go on as 2; process 3
    restarts rank 2, which heals from a live member; AFTER_JOIN updates later rank 1 is
    SIGKILLed and ranks 0 and 2 finish.  Returns each survivor's variables, its membership
    changes, the step it started from and whether it opened a file."""
    joiner = ctx.rank == 3
    me = 2 if joiner else ctx.rank
    if joiner:
        ctx.wait_signal(0, "alone", timeout=120)  # the survivors made updates without it
    store = _store(ctx, port, joiner)
    if not joiner:
        dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    w = torch.nn.Parameter(start_w())
    opened = files_opened()
    extra = {"worker": 2, "store": store} if joiner else {}
    opt = SyncReplicasOptimizer(
        torch.optim.Adam([w], lr=LR), N, N, max_losses=1, timeout=30, **extra
    )
    joined_at = opt.global_step if joiner else None
    steps = []
    while True:
        if joined_at is None:
            joins = [c for c in opt.membership_changes if c["event"] == "joined"]
            joined_at = joins[0]["global_step"] if joins else None
        if joined_at is not None and opt.global_step >= joined_at + END_AFTER_JOIN:
            break
        w.grad = gradient(me, opt.local_step, w.detach())
        opt.step()
        steps.append(opt.global_step)
        if me == 0 and opt.global_step == FIRST_LOSS + ALONE:
            ctx.signal("alone")
        if me == 2 and not joiner and opt.global_step == FIRST_LOSS:
            ctx.signal("die")
            time.sleep(60)
        if me == 1 and joined_at is not None and opt.global_step == joined_at + AFTER_JOIN:
            ctx.signal("die")
            time.sleep(60)
        if joined_at is None:
            time.sleep(0.1)  # while rank 2 is away: leave it time to start
        if len(steps) > 2000:
            raise RuntimeError("rank 2 never came back")
    out = {
        "w": w.detach().tolist(),
        "changes": opt.membership_changes,
        "start": opt.exchange.start_step,
        "steps": steps,
        "opened": opened,
        "counters": {str(k): v for k, v in opt.worker_counters().items()},
    }
    opt.close()
    return json.loads(json.dumps(out))


HANG_AT = 4  # rank 2 stops itself (SIGSTOP) after this update
HANG_ALONE = 3  # updates of ranks 0 and 1 before rank 0 lets it go on (SIGCONT)
HANG_AFTER = 6  # updates of all three after it is back
HANG_TIMEOUT = 60  # the collectives' timeout: a hang noticed only there fails the test


def hang_and_return(ctx: RankContext, port: int) -> dict:
    """Rank 2 stops (SIGSTOP: alive, silent, its sockets open) after update HANG_AT; ranks 0
    and 1 go on without it; HANG_ALONE updates later rank 0 sends it SIGCONT, and it takes
    its place again from their live state; HANG_AFTER updates later all stop.  Returns each
    rank's variables, steps, membership changes and its longest step() call."""
    store = _store(ctx, port, False)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    w = torch.nn.Parameter(start_w())
    opt = SyncReplicasOptimizer(
        torch.optim.Adam([w], lr=LR), N, N, max_losses=1, timeout=HANG_TIMEOUT
    )
    steps: list[int] = []
    longest, back_at = 0.0, None  # the step at which all three are members again
    while back_at is None or opt.global_step < back_at + HANG_AFTER:
        w.grad = gradient(ctx.rank, opt.local_step, w.detach())
        started = time.monotonic()
        opt.step()
        longest = max(longest, time.monotonic() - started)
        steps.append(opt.global_step)
        if ctx.rank == 2 and len(steps) == HANG_AT:
            store.set("test/stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0's SIGCONT lets it go on here
        elif ctx.rank == 2 and len(steps) == HANG_AT + 1:
            back_at = opt.global_step  # healed to the members' step
        changes = {c["event"]: c["global_step"] for c in opt.membership_changes}
        if ctx.rank == 0 and "lost" in changes and opt.global_step == changes["lost"] + HANG_ALONE:
            os.kill(int(store.get("test/stopped")), signal.SIGCONT)
        if ctx.rank != 2:
            back_at = changes.get("joined")
            if "lost" in changes and back_at is None:
                time.sleep(0.1)  # while rank 2 is away: leave it time to come back
        if len(steps) > 500:
            raise RuntimeError("rank 2 never came back")
    out = {
        "w": w.detach().tolist(),
        "changes": opt.membership_changes,
        "steps": steps,
        "longest": longest,
    }
    opt.close()
    return json.loads(json.dumps(out))


def two_lost(ctx: RankContext) -> str:
    """Ranks 1 and 2 are SIGKILLed after update 2 with max_losses=1: rank 0 reports."""
    w = torch.nn.Parameter(start_w())
    opt = SyncReplicasOptimizer(torch.optim.SGD([w], lr=LR), N, N, max_losses=1, timeout=30)
    for _ in range(2):
        w.grad = gradient(ctx.rank, opt.local_step, w.detach())
        opt.step()
    if ctx.rank:
        ctx.signal("die")
        time.sleep(60)
    ctx.wait_signal(1, "die")
    ctx.wait_signal(2, "die")
    w.grad = gradient(0, opt.local_step, w.detach())
    started = time.monotonic()
    try:
        opt.step()
    except RuntimeError as exc:
        return f"{time.monotonic() - started:.1f} {exc}"
    return "no error"
