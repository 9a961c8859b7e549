"""Rank functions for tests/distributed/sync/test_sync_exchanges.py: SyncReplicas jobs with the
default exchange (all-reduce for R == N) and with a named server, plain training loops."""

from __future__ import annotations

import time

import torch

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer
from gradfleet.distributed.sync.worker import buckets
from gradfleet.distributed.testing import RankContext
from tests.distributed.sims import batch, make_mlp, mse

CLIP = 0.05


def lockstep_job(
    ctx: RankContext, steps: int, mode: str, kwargs: dict, bucket_bytes: int | None = None
) -> dict:
    """``steps`` updates of an MLP (float64, Adam) from a model each rank initialises
    differently; ``mode``: "plain", "clip" (clip_grad_norm_ between backward and step) or
    "accumulate" (two backward passes per step).  ``bucket_bytes``: the all-reduce exchange's
    bucket size (default DDP's: the MLP fits one bucket; 8: a bucket per parameter, so that
    backward sends all but the last, which carries the flags)."""
    if bucket_bytes is not None:
        buckets.FIRST_BUCKET_BYTES = buckets.BUCKET_BYTES = bucket_bytes
    model = make_mlp(100 + ctx.rank)
    opt = SyncReplicasOptimizer(
        gradfleet.AdamOptimizer(model.parameters(), 0.01), ctx.world_size, timeout=30, **kwargs
    )
    for step in range(steps):
        opt.zero_grad()
        if mode == "accumulate":
            for half in (0, 1):
                mse(model, *batch(ctx.rank, 2 * step + half)).backward()
        else:
            mse(model, *batch(ctx.rank, step)).backward()
        if mode == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    out = {
        "transport": opt.transport,
        "global_step": opt.global_step,
        "params": [p.detach().clone() for p in model.parameters()],
        "counters": dict(opt.counters),
    }
    if opt.transport == "allreduce":
        out["overlap"] = opt.exchange.overlap
        out["sent_in_backward"] = opt.exchange.sent_in_backward
        out["buckets"] = len(opt.exchange.buckets)
    if ctx.rank == 0:
        out["server_counters"] = opt.worker_counters()
    opt.close()
    return out


def simulate_lockstep(world: int, steps: int, mode: str) -> list[torch.Tensor]:
    """float64 reference: every update averages one gradient per worker, each computed on the
    current variables (clipped per worker first, as TF's ``apply_gradients`` gets them)."""
    model = make_mlp(100)  # rank 0's initial values: the others read them
    opt = gradfleet.AdamOptimizer(model.parameters(), 0.01)
    params = list(model.parameters())
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad()
            if mode == "accumulate":
                for half in (0, 1):
                    mse(model, *batch(rank, 2 * step + half)).backward()
            else:
                mse(model, *batch(rank, step)).backward()
            if mode == "clip":
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            for t, p in zip(total, params, strict=True):
                t += p.grad
        opt.apply_gradients([(t / world, p) for t, p in zip(total, params, strict=True)])
    return [p.detach().clone() for p in params]


def sparse_and_missing(ctx: RankContext) -> dict:
    """One update from explicit gradients: a row-sparse one (rows {rank, 3}), a dense one on
    rank 0 only, and a parameter no rank has a gradient for."""
    emb = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    unused = torch.ones(2, dtype=torch.float64, requires_grad=True)
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer([emb, bias, unused], 1.0), ctx.world_size, timeout=30
    )
    rows = torch.tensor([[ctx.rank, 3]])
    values = torch.tensor([[1.0, 2.0], [10.0 * (ctx.rank + 1), 1.0]], dtype=torch.float64)
    pairs = [(torch.sparse_coo_tensor(rows, values, (4, 2)), emb)]
    if ctx.rank == 0:
        pairs.append((torch.tensor([3.0, 6.0, 9.0], dtype=torch.float64), bias))
    gs = torch.zeros((), dtype=torch.int64)
    opt.apply_gradients(pairs, gs)
    out = {"transport": opt.transport, "global_step": int(gs)}
    out.update(emb=emb.detach().clone(), bias=bias.detach().clone(), unused=unused.detach().clone())
    opt.close()
    return out


def fixed_loop(ctx: RankContext, steps: int, kwargs: dict, slow: int | None) -> dict:
    """A plain torch loop, ``for step in range(steps)``; rank ``slow`` sleeps 0.4 s a step.
    Returns when each rank finished or failed (wall clock) and what it raised."""
    model = make_mlp(7)
    opt = SyncReplicasOptimizer(
        gradfleet.GradientDescentOptimizer(model.parameters(), 0.05), timeout=30, **kwargs
    )
    out: dict = {"error": None, "steps": 0}
    try:
        for step in range(steps):
            opt.zero_grad()
            mse(model, *batch(ctx.rank, step)).backward()
            opt.step()
            out["steps"] += 1
            if ctx.rank == slow:
                time.sleep(0.4)
    except (RuntimeError, TimeoutError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["end"] = time.time()
    out["global_step"] = opt.global_step
    opt.close()
    return out


def lost_peer(ctx: RankContext) -> str:
    """The default exchange (R == N, all-reduce); rank 1 is SIGKILLed after 3 steps."""
    model = make_mlp(7)
    opt = SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer(model.parameters(), 0.05), 2)
    start = time.monotonic()
    try:
        for step in range(1000):
            opt.zero_grad()
            mse(model, *batch(ctx.rank, step)).backward()
            opt.step()
            if ctx.rank == 1 and step == 2:
                ctx.signal("die")
                time.sleep(60)  # the harness kills this rank
    except RuntimeError as exc:
        return f"RuntimeError after {time.monotonic() - start:.1f}s: {exc}"
    return "finished"


def laid_out(ctx: RankContext, assignment: str | None, ranks: list[int] | None = None) -> dict:
    """2 workers, 4 steps with the model given, shards on ``ranks`` (default 0 and 1; 2 MiB of
    variables each), or one server (``[0]``, or ``[2]``: a dedicated rank that only serves;
    8 MiB; no standby, whose chief keeps one shard); ``assignment`` None: laid out for the
    job."""
    from torch import nn

    from gradfleet.distributed import serve

    ranks = [0, 1] if ranks is None else ranks
    if ctx.rank >= 2:
        return {"served": serve(lambda groups: gradfleet.AdamOptimizer(groups, 0.01))["kind"]}
    torch.manual_seed(3)
    width = 1024 if len(ranks) == 1 else 512
    model = nn.Sequential(
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 1)
    )
    opt = SyncReplicasOptimizer(
        gradfleet.AdamOptimizer(model.parameters(), 0.01),
        2,
        2,
        timeout=30,
        server_ranks=ranks,
        shard_assignment=assignment,
        model=model,
        standby=False,
    )
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, width, generator=gen)).pow(2).mean().backward()
        opt.step()
    opt.wait_reads()
    out = {
        "assignment": "backward_order" if opt.exchange.layout.split else "bytes",
        "shards": list(opt.server_ranks),
        "streaming": opt.streaming,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    opt.close()
    return out


def backups_layout(ctx: RankContext, transport: str | None, standby: bool | None = None) -> dict:
    """R = 2 of 3, no server rank named, the model given: the exchange, the losses it goes on
    without, where the variables are and the chief's standby."""
    from torch import nn

    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024))
    opt = SyncReplicasOptimizer(
        gradfleet.AdamOptimizer(model.parameters(), 0.01), 2, 3, timeout=30, model=model,
        transport=transport, standby=standby,
    )  # fmt: skip
    exchange = opt.exchange
    out = {
        "exchange": type(exchange).__name__,
        "max_losses": getattr(exchange, "max_losses", None),
        "shards": list(opt.server_ranks),
        "streaming": opt.streaming,
        "standby": getattr(exchange, "standby", None),
    }
    opt.close()
    return out


def nonfinite_once(ctx: RankContext) -> dict:
    """The default exchange; rank 1's gradient turns NaN after backward at step 1 (so also
    after overlap sent it): every rank hears of it, nothing is applied, training goes on.  At
    step 3 rank 0's gradient holds a finite 1e200, whose square overflows the screen's norm:
    the exact check clears it, and the update is made."""
    model = make_mlp(7)
    opt = SyncReplicasOptimizer(gradfleet.GradientDescentOptimizer(model.parameters(), 0.05), 2)
    errors, before = [], None
    for step in range(4):
        opt.zero_grad()
        mse(model, *batch(ctx.rank, step)).backward()
        if step == 1:
            before = [p.detach().clone() for p in model.parameters()]
            if ctx.rank == 1:
                model[0].weight.grad[0, 0] = float("nan")
        if step == 3 and ctx.rank == 0:
            model[0].weight.grad[0, 0] = 1e200
        try:
            opt.step()
        except FloatingPointError as exc:
            errors.append((step, str(exc)))
            after = [p.detach().clone() for p in model.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    out = {
        "errors": errors,
        "global_step": opt.global_step,
        "params": [p.detach().clone() for p in model.parameters()],
    }
    opt.close()
    return out
