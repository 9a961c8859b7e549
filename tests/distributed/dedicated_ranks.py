"""Rank functions for the dedicated-server tests (run by ``run_ranks``): ranks ``0 .. N-1``
train, ranks from ``N`` on only serve."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import gradfleet
from gradfleet.distributed import (
    AsyncCentre,
    ElasticAverageOptimizer,
    ParameterServer,
    SyncReplicasOptimizer,
    serve,
)
from gradfleet.distributed.testing import RankContext
from gradfleet.distributed.transport import ServerUnreachable

from .sync_ranks import _die, loss_of, make_model

LR, LR_LATER, LR_DROP_AT = 0.01, 0.003, 3


def adam(groups):
    return gradfleet.AdamOptimizer(groups, LR)


def _state_path(ctx: RankContext, directory: str) -> Path:
    return Path(directory, f"server-{ctx.rank}.pt")


def sync_train(
    ctx: RankContext,
    N: int,
    server_ranks: list[int],
    steps: int,
    start: int = 0,
    state_dir: str | None = None,
    assignment: str = "bytes",
    overlap: bool = False,
) -> dict:
    """R = N = ``N`` workers in lockstep (no initial tokens), Adam whose LR drops after the
    worker's step ``LR_DROP_AT``; rank >= N serves (resuming from ``state_dir`` when
    ``start`` > 0, saving its final state there).  ``overlap``: pushes leave during backward
    (several shards: with ``nonfinite="apply"``)."""
    if ctx.rank >= N:
        state = None
        if start:
            state = torch.load(_state_path(ctx, state_dir), weights_only=True)
        final = serve(adam, state=state)
        if state_dir is not None:
            torch.save(final, _state_path(ctx, state_dir))
        return {"served": final["kind"]}
    model = make_model(width=4)
    inner = gradfleet.AdamOptimizer(model.parameters(), LR)
    # lockstep: every worker stops at ``steps`` with no token left over (no last_step, whose
    # early release would leave the last update's tokens in a checkpoint)
    opt = SyncReplicasOptimizer(
        inner, N, N, num_tokens=0, timeout=30, server_ranks=server_ranks,
        shard_assignment=assignment, overlap=overlap, nonfinite="apply" if overlap else "raise",
    )  # fmt: skip
    trace = []
    count = start
    while opt.global_step < steps:
        if count == LR_DROP_AT:
            for g in inner.param_groups:
                g["lr"] = LR_LATER
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        opt.step()
        count += 1
        trace.append((opt.global_step, [p.detach().clone() for p in model.parameters()]))
    out = {"trace": trace, "counters": dict(opt.counters), "dedicated": opt.dedicated}
    out["pieces"] = len(opt.exchange.layout.pieces)  # the variables the shards hold (split: more)
    opt.close()
    return out


def sync_server_lost(ctx: RankContext, N: int, server_ranks: list[int], victim: int) -> dict:
    """Workers train until an error; server rank ``victim`` dies once every worker made 3 steps
    (a worker still connecting when it dies would fail in the constructor, not in step())."""
    if ctx.rank >= N:
        server = ParameterServer(adam)
        if ctx.rank == victim:
            for worker in range(N):
                ctx.wait_signal(worker, "stepped", timeout=60)
            _die(ctx)
        server.join()
        return {}
    model = make_model(width=4)
    opt = SyncReplicasOptimizer(
        gradfleet.AdamOptimizer(model.parameters(), LR), N, N,
        timeout=30, server_ranks=server_ranks,
    )  # fmt: skip
    addresses = list(opt.server_addresses)
    errors = []
    count = 0
    start = time.monotonic()
    while time.monotonic() - start < 60:
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        try:
            opt.step()
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
            break
        count += 1
        if count == 3:
            ctx.signal("stepped")
    failed_at = time.monotonic()
    opt.close()
    return {
        "errors": errors,
        "addresses": addresses,
        "close_s": time.monotonic() - failed_at,
        "unreachable": ServerUnreachable.__name__,
    }


def easgd_train(ctx: RankContext, N: int, server_rank: int, steps: int) -> dict:
    """Asynchronous EASGD, ``communication_period`` 2; rank ``N`` (if it exists) serves."""
    if ctx.rank >= N:
        return serve()
    model = make_model(width=4)
    opt = ElasticAverageOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
        N, 2, mode=AsyncCentre(server_rank=server_rank, timeout=30),
    )  # fmt: skip
    for count in range(steps):
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        opt.step()
    # asynchronous: a fast worker may finish before a slow one joined; the counters are
    # read once every worker is done, so each sees every join
    ctx.signal("trained")
    for r in range(N):
        ctx.wait_signal(r, "trained", timeout=60)
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "local_centre": [c.clone() for c in opt.local_centre()],
        "counters": opt._strategy.counters(),
    }
    if N == 1:
        out["centre"] = [c.clone() for c in opt.centre()]
    opt.close()
    return out


def easgd_server_lost(ctx: RankContext, N: int) -> dict:
    """The dedicated centre (rank ``N``), without a standby, dies once worker 0 exchanged
    twice."""
    if ctx.rank >= N:
        server = ParameterServer()
        ctx.wait_signal(0, "stepped", timeout=30)
        _die(ctx)
        server.join()
        return {}
    model = make_model(width=4)
    opt = ElasticAverageOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.05),
        N, 1, mode=AsyncCentre(server_rank=N, timeout=30, standby=False),
    )  # fmt: skip
    address = opt._strategy.address
    errors = []
    start = time.monotonic()
    count = 0
    while time.monotonic() - start < 60:
        opt.zero_grad()
        loss_of(model, ctx.rank, count).backward()
        try:
            opt.step()
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
            break
        count += 1
        if count == 2 and ctx.rank == 0:
            ctx.signal("stepped")
    opt.close()
    return {"errors": errors, "address": address}


def serve_without_optimizer(ctx: RankContext) -> str:
    """Rank 1 serves a SyncReplicas job without the optimizer factory: every rank raises."""
    try:
        if ctx.rank == 1:
            serve()
        else:
            model = make_model(width=4)
            SyncReplicasOptimizer(
                gradfleet.GradientDescentOptimizer(model.parameters(), 0.1), 1, 1,
                server_ranks=[1], timeout=10,
            )  # fmt: skip
    except RuntimeError as exc:
        return str(exc)
    return "no error"
