"""Rank functions run by ``gradfleet.distributed.testing.run_ranks`` (importable by path)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

import gradfleet
from gradfleet.distributed import ElasticAverageOptimizer, ModelAverageOptimizer
from gradfleet.distributed.testing import RankContext

from .sims import F64, batch, make_bn_model, make_mlp, mse, snapshot


# --------------------------------------------------------------------- harness self-tests
def all_reduce_rank(ctx: RankContext) -> float:
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("rank 1 exploded")
    dist.barrier()  # rank 0 waits for a peer that is gone


def fail_rank1_alone(ctx: RankContext) -> str:
    if ctx.rank == 1:
        raise ValueError("rank 1 exploded")
    return "done"  # rank 0 needs no peer


def sleep_forever(ctx: RankContext) -> None:
    time.sleep(600)


def killed_mid_run(ctx: RankContext) -> str:
    if ctx.rank == 1:
        ctx.signal("ready")
        time.sleep(600)  # the parent SIGKILLs us here
    ctx.wait_signal(1, "ready")
    return "survived"


# --------------------------------------------------------------------- init()
def init_from_env(ctx: RankContext) -> dict:
    from gradfleet.distributed import init

    assert not dist.is_initialized()
    info = init(timeout=7)
    again = init()  # idempotent: same group, nothing created
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"info": info, "again": again, "sum": t.item(), "backend": dist.get_backend()}


def init_without_launcher(ctx: RankContext) -> dict:
    from gradfleet.distributed import init, shutdown

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(key, None)
    info = init()
    opt = ModelAverageOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=1.0), 1, 1)
    shutdown()
    return {"info": info, "after": dist.is_initialized(), "ma": opt.num_worker}


def init_after_user_group(ctx: RankContext) -> dict:
    from gradfleet.distributed import init, shutdown

    info = init(backend="gloo")  # the harness already created the group
    shutdown()  # must not destroy a group init() did not create
    return {"info": info, "still": dist.is_initialized()}


# --------------------------------------------------------------------- ModelAverage
def model_average_oracle(ctx: RankContext) -> dict:
    """TF model_average_optimizer_test: 2 workers, interval 2, SGD lr 1, v0=0, v1=1."""
    out = {}
    for family in ("torch", "gradfleet"):
        v0 = nn.Parameter(torch.tensor(0.0, dtype=F64))
        v1 = nn.Parameter(torch.tensor(1.0, dtype=F64))
        if family == "torch":
            inner = torch.optim.SGD([v0, v1], lr=1.0)
        else:
            inner = gradfleet.GradientDescentOptimizer([v0, v1], 1.0)
        opt = ModelAverageOptimizer(inner, num_worker=2, interval_steps=2)
        g = torch.tensor(-1.0 if ctx.rank == 0 else -2.0, dtype=F64)
        gstep = torch.zeros((), dtype=torch.int64)
        snaps = []
        steps = 3 if ctx.rank == 0 else 2  # step 3 runs on worker 0 only
        for _ in range(steps):
            opt.apply_gradients([(g, v0), (g, v1)], global_step=gstep)
            snaps.append((v0.item(), v1.item(), int(gstep), opt.global_step, opt.local_step))
        out[family] = snaps
    return out


def model_average_random(ctx: RankContext, interval: int, steps: int) -> dict:
    model = make_bn_model(seed=100 + ctx.rank)  # different per rank: the broadcast fixes it
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = ModelAverageOptimizer(
        inner,
        num_worker=ctx.world_size,
        interval_steps=interval,
        buffers=model.buffers(),
        average_optimizer_state=True,
    )
    traj = []
    for s in range(steps):
        opt.zero_grad()
        mse(model, *batch(ctx.rank, s)).backward()
        opt.step()
        traj.append(snapshot(model, inner))
    return {"traj": traj, "global_step": opt.global_step, "local_step": opt.local_step}


# --------------------------------------------------------------------- EASGD
def easgd_opt_fn(family: str):
    if family == "torch":
        return lambda params, lr: torch.optim.Adam(params, lr=lr)
    return lambda params, lr: gradfleet.AdamOptimizer(params, lr)


def easgd_random(ctx: RankContext, tau: int, steps: int, family: str, lr: float) -> dict:
    model = make_mlp(seed=100 + ctx.rank)
    inner = easgd_opt_fn(family)(list(model.parameters()), lr)
    opt = ElasticAverageOptimizer(inner, num_worker=ctx.world_size, communication_period=tau)
    traj, centres = [], []
    x_y = [batch(ctx.rank, s) for s in range(steps)]
    for s in range(steps):
        x, y = x_y[s]
        opt.minimize(lambda x=x, y=y: mse(model, x, y))
        traj.append([p.detach().clone() for p in model.parameters()])
        centres.append([c.clone() for c in opt.centre()])
    return {
        "traj": traj,
        "centres": centres,
        "global_step": opt.global_step,
        "moving_rate": opt.moving_rate,
    }
