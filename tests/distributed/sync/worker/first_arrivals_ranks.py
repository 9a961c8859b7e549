"""Rank functions for backup workers without a server (run by ``run_ranks``).

Each gradient is a function of (rank, the step it was computed at, the variables), so a
float64 replay knows every update from the members that made it, as the leaders announced
them on the store."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradfleet import AdamOptimizer
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.testing import RankContext

from .elastic_ranks import files_opened, gradient, start_w

N, R = 3, 2
# steps 0..ROTATE-1: rank step % N is slow, SLOW_S x (step + 1) longer, and the other two make
# the update.  It grows because a worker left out receives the update late and stays about as
# late as it was slow: the next slow worker must be later still, by SLOW_S, to be the one left
# out whatever the load.
ROTATE = 6
LAST = 24  # last_step
NAN_AT = 3  # rank 1's first gradient at this step is NaN: it raises, then sends a finite one
LR = 0.05
SLOW_S = 0.3


def start_table() -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, 12, dtype=torch.float64).reshape(4, 3)


def table_gradient(rank: int, step: int) -> torch.Tensor:
    """A sparse gradient of the 4-row table: rows ``rank`` and ``rank + 1`` (rows shared by
    two ranks are divided by the members that sent them)."""
    rows = torch.tensor([[rank % 4, (rank + 1) % 4]])
    values = torch.cos(torch.arange(6, dtype=torch.float64) + rank + 0.2 * step).reshape(2, 3)
    return torch.sparse_coo_tensor(rows, values, (4, 3)).coalesce()


def backups(ctx: RankContext) -> dict:
    """R = 2 of N = 3 with ``transport="allreduce"`` until LAST: first a slow rank that moves
    from step to step, then none; rank 1 meets a NaN once.  Returns the variables, each
    step() call's outcome, the counters, the NaN's verdict and (rank 0) every update's
    members."""
    w, table = torch.nn.Parameter(start_w()), torch.nn.Parameter(start_table())
    opt = SyncReplicasOptimizer(
        AdamOptimizer([w, table], LR), R, N, transport="allreduce", last_step=LAST, timeout=60
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
        table.grad = table_gradient(ctx.rank, step)
        if step < ROTATE and step % N == ctx.rank:
            time.sleep(SLOW_S * (step + 1))
        opt.step()
        calls.append((step, bool(opt.last_gradient_accepted), opt.global_step))
    out = {
        **_made(ctx, opt, w, table),
        "calls": calls,
        "counters": {str(k): v for k, v in opt.worker_counters().items()},
        "history": opt.replicas_history(),
        "nan": nan,
    }
    opt.close()
    dist.barrier()
    return json.loads(json.dumps(out))


def _made(ctx: RankContext, opt: Any, w: torch.Tensor, table: torch.Tensor) -> dict:
    """The variables, and on rank 0 every update's members as its leader announced them."""
    plan = None
    if ctx.rank == 0:
        board = opt.exchange.board
        plan = [list(board.wait_made(t).members) for t in range(LAST)]
    return {"w": w.detach().tolist(), "table": table.detach().tolist(), "plan": plan}


LOST_AT = 4  # rank 2 is killed after this many step() calls


def lose_one(ctx: RankContext) -> dict:
    """R = 2 of N = 3 without a server, losses turned off (``max_losses=0``); rank 2 is
    SIGKILLed (by the harness) after LOST_AT step() calls.  The others keep stepping until the
    exchange says the peer is gone; each returns its error and how long after the kill it
    came."""
    w = torch.nn.Parameter(start_w())
    opt = SyncReplicasOptimizer(
        torch.optim.Adam([w], lr=LR), R, N, transport="allreduce", last_step=10_000, timeout=60,
        max_losses=0,
    )  # fmt: skip
    calls = 0
    try:
        while True:
            w.grad = gradient(ctx.rank, opt.local_step, w.detach())
            if ctx.rank == 2:
                time.sleep(0.05)  # the backup: late at every step
            opt.step()
            calls += 1
            if ctx.rank == 2 and calls == LOST_AT:
                ctx.signal("die")
                time.sleep(60)
    except RuntimeError as exc:
        signalled = Path(ctx.workdir, "signal-2-die").stat().st_mtime  # just before the kill
        return {"error": str(exc), "after_kill": time.time() - signalled}


RESUME_AT, RESUME_END = 5, 10  # a checkpoint at update RESUME_AT; each run goes on to RESUME_END


def resume(ctx: RankContext) -> dict:
    """R = 2 of N = 3 without a server: to RESUME_AT, a checkpoint, on to RESUME_END; then the
    checkpoint loaded into the same optimizer (on every rank, as a resumed job does) and on to
    RESUME_END again, through steps the store has seen before.  Returns the variables at each
    end and (rank 0) the members of every update of both passes."""
    w, table = torch.nn.Parameter(start_w()), torch.nn.Parameter(start_table())
    opt = SyncReplicasOptimizer(
        AdamOptimizer([w, table], LR), R, N, transport="allreduce", last_step=RESUME_END,
        timeout=60,
    )  # fmt: skip

    def train_to(end: int) -> None:
        while opt.global_step < end:
            step = opt.local_step
            w.grad = gradient(ctx.rank, step, w.detach())
            table.grad = table_gradient(ctx.rank, step)
            if step % N == ctx.rank:
                time.sleep(0.1)
            opt.step()

    def members(start: int, end: int) -> list[list[int]] | None:
        board = opt.exchange.board
        return (
            [list(board.wait_made(t).members) for t in range(start, end)] if ctx.rank == 0 else None
        )

    train_to(RESUME_AT)
    saved = copy.deepcopy({"opt": opt.state_dict(), "w": w.detach(), "table": table.detach()})
    dist.barrier()
    train_to(RESUME_END)
    first = {"w": w.detach().tolist(), "plan": members(0, RESUME_END)}
    dist.barrier()
    with torch.no_grad():
        w.copy_(saved["w"])
        table.copy_(saved["table"])
    opt.load_state_dict(saved["opt"])
    train_to(RESUME_END)
    second = {"w": w.detach().tolist(), "plan": members(RESUME_AT, RESUME_END),
              "global_step": opt.global_step}  # fmt: skip
    opt.close()
    dist.barrier()
    return json.loads(json.dumps({"first": first, "second": second}))


LOSS_LAST = 24  # last_step of the jobs that lose a worker
KILLED_AT = 8  # the lost worker is SIGKILLed once it holds this update
BACK_AFTER = 4  # updates the two left make before rank 2 is restarted (or woken)
REJOIN_LAST = 40  # last_step of the jobs that take rank 2 back


def _elastic_store(ctx: RankContext, port: int) -> dist.Store:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=ctx.rank == 0, wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )  # fmt: skip


def _losses_allowed(last: int, **extra) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The variables and a ``max_losses=1`` optimizer of R = 2 of N = 3 without a server."""
    w, table = torch.nn.Parameter(start_w()), torch.nn.Parameter(start_table())
    opt = SyncReplicasOptimizer(
        AdamOptimizer([w, table], LR), R, N, transport="allreduce", max_losses=1,
        last_step=last, timeout=60, **extra,
    )  # fmt: skip
    return w, table, opt


def _step(opt: Any, w: torch.Tensor, table: torch.Tensor, rank: int) -> float:
    """Compute (rank 2 the slowest) and step; the seconds step() took."""
    step = opt.local_step
    w.grad = gradient(rank, step, w.detach())
    table.grad = table_gradient(rank, step)
    time.sleep(0.04 if rank == 2 else 0.02)
    started = time.monotonic()
    opt.step()
    return time.monotonic() - started


def _back_after(opt: Any) -> bool:
    """Have the others made BACK_AFTER updates since they lost a member?"""
    lost = [c for c in opt.membership_changes if c["event"] == "lost"]
    return bool(lost) and opt.global_step >= lost[0]["global_step"] + BACK_AFTER


def lose_and_go_on(ctx: RankContext, port: int, lost: int) -> dict:
    """R = 2 of N = 3 without a server, ``max_losses=1``; rank 2 is a little slow (the usual
    backup); rank ``lost`` is SIGKILLed (by the harness) once it holds update KILLED_AT, and
    the others go on to LOSS_LAST.  Returns the survivors' variables, their record of each
    update's members, the membership changes and the longest step() call after the loss."""
    store = _elastic_store(ctx, port)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    w, table, opt = _losses_allowed(LOSS_LAST)
    longest = 0.0
    while opt.global_step < LOSS_LAST:
        longest = max(longest, _step(opt, w, table, ctx.rank))
        if ctx.rank == lost and opt.global_step >= KILLED_AT:
            ctx.signal("die")
            time.sleep(60)
    out = {
        "w": w.detach().tolist(),
        "table": table.detach().tolist(),
        "history": opt.exchange.history,
        "changes": opt.membership_changes,
        "live": opt.live_workers,
        "longest": longest,
        "counters": {str(k): v for k, v in opt.worker_counters().items()},
    }
    opt.close()
    return json.loads(json.dumps(out))


def lose_and_rejoin(ctx: RankContext, port: int) -> dict:
    """R = 2 of N = 3 without a server, ``max_losses=1``: rank 2 is SIGKILLed once it holds
    update KILLED_AT; ranks 0 and 1 go on; BACK_AFTER updates later process 3 restarts rank 2
    (``worker=2`` and the job's store), which heals from a live member's state (no file
    opened) and takes its place again; all go on to REJOIN_LAST."""
    joiner = ctx.rank == 3
    me = 2 if joiner else ctx.rank
    if joiner:
        ctx.wait_signal(0, "alone", timeout=120)
    store = _elastic_store(ctx, port)
    if not joiner:
        dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    opened = files_opened()
    extra = {"worker": 2, "store": store} if joiner else {}
    w, table, opt = _losses_allowed(REJOIN_LAST, **extra)
    start = opt.global_step
    signalled = False
    while opt.global_step < REJOIN_LAST:
        _step(opt, w, table, me)
        if me == 2 and not joiner and opt.global_step >= KILLED_AT:
            ctx.signal("die")
            time.sleep(60)
        if me == 0 and not signalled and _back_after(opt):
            ctx.signal("alone")
            signalled = True
    out = {
        "w": w.detach().tolist(),
        "table": table.detach().tolist(),
        "history": opt.exchange.history,
        "changes": opt.membership_changes,
        "live": opt.live_workers,
        "start": start,
        "opened": opened,
    }
    opt.close()
    return json.loads(json.dumps(out))


def hang_and_return(ctx: RankContext, port: int) -> dict:
    """R = 2 of N = 3 without a server, ``max_losses=1``: rank 2 stops itself (SIGSTOP: alive,
    silent, its sockets open) once it holds update KILLED_AT; ranks 0 and 1 go on; BACK_AFTER
    updates later rank 0 lets it go on (SIGCONT), and it takes its place again from their live
    state; all go on to REJOIN_LAST.  Returns each rank's variables, record, membership
    changes and longest step() call."""
    store = _elastic_store(ctx, port)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=N)
    w, table, opt = _losses_allowed(REJOIN_LAST)
    longest, stopped, woken = 0.0, False, False
    while opt.global_step < REJOIN_LAST:
        longest = max(longest, _step(opt, w, table, ctx.rank))
        if ctx.rank == 2 and not stopped and opt.global_step >= KILLED_AT:
            stopped = True
            store.set("test/stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0's SIGCONT lets it go on here
        if ctx.rank == 0 and not woken and _back_after(opt):
            os.kill(int(store.get("test/stopped")), signal.SIGCONT)
            woken = True
    out = {
        "w": w.detach().tolist(),
        "history": opt.exchange.history,
        "changes": opt.membership_changes,
        "longest": longest,
    }
    opt.close()
    return json.loads(json.dumps(out))


HEARD_N, HEARD_UPDATES, SLOW_UNTIL = 4, 80, 20
COMPUTE_S, SLOWER_S = 0.04, 0.12  # every rank's gradient; the last rank's until SLOW_UNTIL


def heard(ctx: RankContext) -> dict:
    """R = 3 of 4, equal ranks but the last, which computes SLOWER_S more until update
    SLOW_UNTIL: every update's members, and how long each rank deferred."""
    w = torch.nn.Parameter(start_w())
    n = HEARD_N
    opt = SyncReplicasOptimizer(
        torch.optim.SGD([w], lr=0.01), n - 1, n, transport="allreduce",
        last_step=HEARD_UPDATES, timeout=60,
    )  # fmt: skip
    while opt.global_step < HEARD_UPDATES:
        w.grad = gradient(ctx.rank, opt.local_step, w.detach())
        slow = ctx.rank == n - 1 and opt.global_step < SLOW_UNTIL
        time.sleep(COMPUTE_S + (SLOWER_S if slow else 0.0))
        opt.step()
    out = {"history": opt.exchange.history, "waited": opt.exchange.deference.waited}
    opt.close()
    dist.barrier()
    return out


SLOW_FROM = 6  # auto_backups: rank 2 computes SLOW_S longer from this step on


def auto_backups(ctx: RankContext) -> dict:
    """``replicas_to_aggregate="auto"`` with ``transport="allreduce"``, N = 3 until LAST; rank 2
    slow from step SLOW_FROM on.  Returns the variables, each update's members (rank 0) and
    the R of every update as each rank recorded it."""
    w, table = torch.nn.Parameter(start_w()), torch.nn.Parameter(start_table())
    opt = SyncReplicasOptimizer(
        AdamOptimizer([w, table], LR), "auto", N, transport="allreduce", last_step=LAST,
        timeout=60,
    )  # fmt: skip
    while opt.global_step < LAST:
        step = opt.local_step
        w.grad = gradient(ctx.rank, step, w.detach())
        table.grad = table_gradient(ctx.rank, step)
        if ctx.rank == 2 and step >= SLOW_FROM:
            time.sleep(SLOW_S)
        opt.step()
    out = {**_made(ctx, opt, w, table), "history": opt.replicas_history()}
    opt.close()
    dist.barrier()
    return json.loads(json.dumps(out))


def close_before_stepping(ctx: RankContext) -> dict:
    """R = 1 of 2, the default exchange (no server): rank 0 closes at once and leaves; rank 1
    steps once (rank 0, late, is owed the update) and closes after rank 0 is gone.  Returns
    what each close raised (None) and rank 1's variables."""
    x = torch.nn.Parameter(torch.zeros(3))
    opt = SyncReplicasOptimizer(torch.optim.SGD([x], lr=0.5), 1, 2, timeout=30)
    raised = None
    if ctx.rank == 1:
        ctx.wait_signal(0, "gone", timeout=60)
        x.grad = torch.ones(3)
        opt.step()
    try:
        opt.close()
    except Exception as exc:  # noqa: BLE001 -- the test reports it
        raised = f"{type(exc).__name__}: {exc}"
    if ctx.rank == 0:
        ctx.signal("gone")
    return {"raised": raised, "x": x.detach().tolist(), "exchange": type(opt.exchange).__name__}
