"""Rank functions of the ``replicas_to_aggregate="auto"`` tests (run by ``run_ranks``)."""

from __future__ import annotations

import logging
import re
import time

import torch
from torch import nn

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer, serve
from gradfleet.distributed.testing import RankContext
from tests.distributed.sync_ranks import _die

DECISION = re.compile(r"update (\d+) (?:now )?waits for R=(\d+)")


class Decisions(logging.Handler):
    """The chief's decisions, as logged (DEBUG)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = DECISION.search(record.getMessage())
        if found:
            self.seen.append((int(found[1]), int(found[2])))


def auto_train(
    ctx: RankContext,
    steps: int,
    server_ranks: list[int] | None = None,
    slow: tuple[int, int, int, float] | None = None,
    die: tuple[int, int] | None = None,
    base: float = 0.05,
    workers: int | None = None,
) -> dict:
    """Train a small noisy regression under ``"auto"`` until ``global_step == steps``.  Each
    worker sleeps ``base`` seconds a step (its accelerator time); ``slow = (rank, first,
    end, seconds)``: that rank sleeps ``seconds`` instead while its global step is in
    ``[first, end)``; ``die = (rank, count)``: that rank is SIGKILLed after ``count`` steps
    (rank 0 then forgets it, so that its server stops waiting at the end).  ``workers``
    (default: every rank): the ranks from it on are dedicated servers."""
    decisions = Decisions()
    chief_log = logging.getLogger("gradfleet.distributed.sync.common.replica_choice")
    chief_log.setLevel(logging.DEBUG)
    chief_log.addHandler(decisions)
    workers = ctx.world_size if workers is None else workers
    if ctx.rank >= workers:
        serve(lambda groups: gradfleet.GradientDescentOptimizer(groups, 0.02))
        return {"decisions": decisions.seen}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.02),
        "auto",
        workers,
        last_step=steps,
        timeout=30.0,
        server_ranks=server_ranks,
    )
    data = torch.Generator().manual_seed(100 + ctx.rank)
    count = 0
    while opt.global_step < steps:
        x = torch.randn(4, 8, generator=data)
        y = x.sum(1, keepdim=True) + 2.0 * torch.randn(4, 1, generator=data)  # noisy targets
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        count += 1
        if die is not None and ctx.rank == die[0] and count == die[1]:
            _die(ctx)
        slowed = slow is not None and ctx.rank == slow[0] and slow[1] <= opt.global_step < slow[2]
        time.sleep(slow[3] if slowed and slow is not None else base)
    out = {"global_step": opt.global_step, "count": count, "history": opt.replicas_history()}
    if die is not None and ctx.rank == 0:
        opt.forget_workers([die[0]])
    opt.close()
    out["decisions"] = decisions.seen
    return out
