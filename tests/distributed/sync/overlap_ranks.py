"""Rank functions for the SyncReplicas overlap tests (run by ``run_ranks``)."""

from __future__ import annotations

import gc

import torch

import gradfleet
from gradfleet.distributed import SyncReplicasOptimizer, serve
from gradfleet.distributed.testing import RankContext
from tests.distributed.sync_ranks import loss_of, make_model

F64 = torch.float64
LR = 0.3


def linear_grads(k: int) -> list[float]:
    """Worker ``k``'s constant gradient for the linear model (``[d/da, d/db]``)."""
    return [0.1 + 0.2 * k, -0.3 + 0.15 * k]


def _linear(k: int):
    a = torch.tensor([0.5], dtype=F64, requires_grad=True)
    b = torch.tensor([-1.0], dtype=F64, requires_grad=True)
    g = linear_grads(k)
    return [a, b], lambda step: g[0] * a.sum() + g[1] * b.sum()


def _mlp(k: int):
    model = make_model()
    return list(model.parameters()), lambda step: loss_of(model, k, step)


def sequenced(
    ctx: RankContext,
    R: int,
    N: int,
    num_tokens: int,
    schedule: list[int],
    server_ranks: list[int] | None,
    nonfinite: str,
) -> dict:
    """Run ``schedule`` (the worker of each step, one step at a time: step ``j`` starts once
    step ``j - 1`` returned, the first once every worker said hello) four times: the linear
    and the MLP model, each with overlap off and on.  Returns, per run, this rank's
    parameters, steps and counters."""
    out = {}
    for model in ("linear", "mlp"):
        for overlap in (False, True):
            params, loss = (_linear if model == "linear" else _mlp)(ctx.rank)
            gc.collect()  # the last run's closed servers go now, not inside the constructor
            opt = SyncReplicasOptimizer(
                gradfleet.GradientDescentOptimizer(params, LR),
                R,
                N,
                num_tokens=num_tokens,
                timeout=30,
                server_ranks=server_ranks,
                nonfinite=nonfinite,
                overlap=overlap,
            )
            tag = f"{model}-{overlap}"
            # every worker's hello (local_step := global_step) before the first step
            ctx.signal(f"{tag}-hello")
            for r in range(ctx.world_size):
                ctx.wait_signal(r, f"{tag}-hello", timeout=30)
            mine = 0
            for j, k in enumerate(schedule):
                if k != ctx.rank:
                    continue
                if j:
                    ctx.wait_signal(schedule[j - 1], f"{tag}-{j - 1}", timeout=30)
                opt.zero_grad()
                loss(mine).backward()
                opt.step()
                mine += 1
                ctx.signal(f"{tag}-{j}")
            out[tag] = {
                "params": [p.detach().clone() for p in params],
                "global_step": opt.global_step,
                "counters": dict(opt.counters),
            }
            opt.close()
    return out


def dedicated_lockstep(
    ctx: RankContext, N: int, server_ranks: list[int], steps: int, assignment: str = "bytes"
) -> dict:
    """R = N workers in lockstep on dedicated server ranks (rank >= N serves), Adam whose LR
    drops after step 2 (the workers send it with their pushes): once without overlap, once
    with.  Returns each run's parameters after every step."""
    out: dict = {}
    for overlap in (False, True):
        gc.collect()
        if ctx.rank >= N:
            serve(lambda groups: gradfleet.AdamOptimizer(groups, 0.01))
            continue
        model = make_model(width=4)
        inner = gradfleet.AdamOptimizer(model.parameters(), 0.01)
        opt = SyncReplicasOptimizer(
            inner, N, N, num_tokens=0, timeout=30, server_ranks=server_ranks,
            nonfinite="apply", overlap=overlap, shard_assignment=assignment,
        )  # fmt: skip
        trace = []
        for count in range(steps):
            if count == 2:
                for group in inner.param_groups:
                    group["lr"] = 0.003
            opt.zero_grad()
            loss_of(model, ctx.rank, count).backward()
            opt.step()
            trace.append((opt.global_step, [p.detach().clone() for p in model.parameters()]))
        out[overlap] = trace
        opt.close()
    return out


# (overlap, stream_reads)
MODES = {
    "read in step": (False, False),
    "streamed": (False, True),
    "streamed+overlap": (True, True),
}


def streamed_lockstep(
    ctx: RankContext, N: int, server_ranks: list[int], steps: int, assignment: str = "bytes"
) -> dict:
    """R = N workers in lockstep (ranks >= N serve), reads in ``step()`` and streamed into the
    next forward, with and without overlap.  Returns per mode the parameters each forward
    used (snapshotted after it: a streamed forward has waited for them), the final ones (from
    ``model.state_dict()``, which waits for every shard), ``global_step`` and counters."""
    out: dict = {}
    for mode, (overlap, stream) in MODES.items():
        gc.collect()
        if ctx.rank >= N:
            serve(lambda groups: gradfleet.AdamOptimizer(groups, 0.01))
            continue
        model = make_model(width=6)
        opt = SyncReplicasOptimizer(
            gradfleet.AdamOptimizer(model.parameters(), 0.01), N, N, num_tokens=0, timeout=30,
            server_ranks=server_ranks, nonfinite="apply", overlap=overlap,
            shard_assignment=assignment,
        )  # fmt: skip
        if stream:
            opt.stream_reads(model)
        used = []
        for count in range(steps):
            opt.zero_grad()
            loss = loss_of(model, ctx.rank, count)
            used.append([p.detach().clone() for p in model.parameters()])
            loss.backward()
            opt.step()
        final = [v.clone() for v in model.state_dict().values()]
        out[mode] = {
            "used": used,
            "final": final,
            "global_step": opt.global_step,
            "counters": dict(opt.counters),
            "accepted": opt.last_gradient_accepted,
        }
        opt.close()
    return out
