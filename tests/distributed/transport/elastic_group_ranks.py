"""Rank functions for the elastic group's tests (run by ``run_ranks``): processes 0-2 are
ranks 0-2, process 3 is rank 2 restarted (``joins_after_the_end``: process 2 is rank 1
restarted)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradfleet.distributed.testing import RankContext
from gradfleet.distributed.transport import LINK_ERRORS, JobEnded
from gradfleet.distributed.transport.elastic_group import ElasticGroup


def _store(ctx: RankContext, port: int, timeout_s: float) -> dist.TCPStore:
    """The job's store, hosted by process 0 (a restarted rank connects as a client)."""
    return dist.TCPStore(
        "127.0.0.1", port, is_master=ctx.rank == 0, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip


def fast_restart(ctx: RankContext, port: int) -> dict:
    """Rank 2 dies after 5 sums and is restarted at once (before its silence counts): the next
    generation has it again, as a new process.  Returns each survivor's view."""
    joiner = ctx.rank == 3
    me = 2 if joiner else ctx.rank
    if joiner:
        ctx.wait_signal(2, "die", timeout=60)
    store = _store(ctx, port, 30)
    # a long silence before a death counts: the restart comes well inside it
    group = ElasticGroup(store, me, 3, timeout=30, joining=joiner, dead_after=20.0)
    seen = {"generation": group.generation, "members": group.members, "changes": []}
    sums = []
    for i in range(5 if joiner else 0, 10):  # the restarted rank takes up the 6th sum
        x = torch.tensor([float(me + 1)])
        try:
            group.all_reduce(x)
        except LINK_ERRORS:
            started = time.monotonic()
            gone, came = group.reform()
            seen["changes"].append(
                [gone, came, group.generation, round(time.monotonic() - started, 2)]
            )
            x = torch.tensor([float(me + 1)])
            group.all_reduce(x)
        sums.append(x.item())
        if me == 2 and not joiner and i == 4:
            ctx.signal("die")
            time.sleep(60)
    seen["sums"] = sums
    group.close()
    return seen


def dies_before_connecting(ctx: RankContext, port: int) -> dict:
    """Rank 2 leaves its group after 3 sums and is decided into the next generation, then dies
    before it connects.  Returns each survivor's view of the change and its sums."""
    store = _store(ctx, port, 60)
    group = ElasticGroup(store, ctx.rank, 3, timeout=60)
    seen: dict = {"changes": []}
    sums = []
    for i in range(6):
        if ctx.rank == 2 and i == 3:

            def die(*_: object, **__: object) -> None:
                ctx.signal("die")
                time.sleep(60)

            group._form = die  # type: ignore[method-assign]  # decided in, never connects
            group.reform()
        x = torch.tensor([float(ctx.rank + 1)])
        try:
            group.all_reduce(x)
        except LINK_ERRORS:
            started = time.monotonic()
            gone, came = group.reform()
            took = round(time.monotonic() - started, 2)
            seen["changes"].append([gone, came, group.generation, group.members, took])
            x = torch.tensor([float(ctx.rank + 1)])
            group.all_reduce(x)
        sums.append(x.item())
    seen["sums"], seen["continuing"] = sums, group.continuing
    group.close()
    return seen


def joins_after_the_end(ctx: RankContext, port: int) -> dict:
    """Ranks 0-1 sum 3 times; rank 1 dies; rank 0 sums 3 more times alone, then closes the
    group (the job's end) and keeps the store up.  Process 2 restarts rank 1 after that close:
    it must be told at once that the job ended, not wait for the group's timeout (60 s).
    Returns rank 0's sums, and process 2's error and how long it took."""
    joiner = ctx.rank == 2
    me = 1 if joiner else ctx.rank
    if joiner:
        ctx.wait_signal(0, "closed", timeout=90)
    store = _store(ctx, port, 60)
    if joiner:
        started = time.monotonic()
        try:
            ElasticGroup(store, me, 2, timeout=60, joining=True)
        except JobEnded as exc:
            seen = {"error": str(exc), "took": time.monotonic() - started}
        else:
            seen = {"error": None}
        ctx.signal("told")
        return seen
    group = ElasticGroup(store, me, 2, timeout=60)
    sums = []
    for i in range(6):
        if me == 1 and i == 3:
            ctx.signal("die")
            time.sleep(60)
        x = torch.tensor([float(me + 1)])
        try:
            group.all_reduce(x)
        except LINK_ERRORS:
            group.reform()
            x = torch.tensor([float(me + 1)])
            group.all_reduce(x)
        sums.append(x.item())
    group.close()
    ctx.signal("closed")
    ctx.wait_signal(2, "told", timeout=90)  # the store lives in this process
    return {"sums": sums, "members": group.members}


def one_leaves_for_the_next(ctx: RankContext, port: int) -> dict:
    """Two members sum 3 times; then rank 1 begins the next generation without joining the
    fourth sum (as a member does that took another for lost on a late heartbeat), while rank
    0 waits in it.  Rank 0 leaves the sum and re-forms too; both sum again in generation 1.
    The group's timeout is 60 s: a wait that ran into it would fail the test's deadline."""
    store = _store(ctx, port, 60)
    group = ElasticGroup(store, ctx.rank, 2, timeout=60)
    sums, seen = [], {}
    for _ in range(3):
        x = torch.tensor([float(ctx.rank + 1)])
        group.all_reduce(x)
        sums.append(x.item())
    if ctx.rank == 0:
        x = torch.tensor([1.0])
        try:
            group.all_reduce(x)
            seen["left"] = None
        except LINK_ERRORS as exc:
            seen["left"] = str(exc)
    # rank 1's old group stays open, as one dropped with a collective abandoned in it does
    # (its destructor waits for that collective): rank 0 is not failed by closed sockets
    held = group.pg if ctx.rank == 1 else None
    seen["changed"] = list(group.reform())
    del held
    x = torch.tensor([float(ctx.rank + 1)])
    group.all_reduce(x)
    sums.append(x.item())
    seen.update(sums=sums, generation=group.generation)
    group.close()
    return seen
