"""Single-process float64 references for the multi-process wrappers, written from the spec
(distributed-semantics.md sections 2, 3 and 5), plus the shared models and data.

The wrapped optimizer is a black box here (the same class the ranks use); what is simulated is
the wrapper's schedule: local steps, TF's phase (after local steps k*interval), exact means,
EASGD's penalty, cached local centre and synchronous elastic exchange.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

F64 = torch.float64


def make_bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 3, generator=gen, dtype=F64)
    y = torch.randn(8, 1, generator=gen, dtype=F64)
    return x, y


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.parameters()]
    out += [b.detach().clone() for b in model.buffers()]
    if opt is not None:
        for p in model.parameters():
            buf = opt.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out.append(buf.clone())
    return out


def _mean_(tensors: list[torch.Tensor]) -> None:
    mean = torch.stack([t.detach() for t in tensors]).sum(0) / len(tensors)
    for t in tensors:
        t.data.copy_(mean)


def simulate_model_average(world: int, interval: int, steps: int) -> list[list[list[torch.Tensor]]]:
    """trajectory[rank][step] = snapshot after that step (params, buffers, momentum)."""
    base = make_bn_model(100)  # every replica starts as rank 0 (the wrapper broadcasts it)
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    traj: list[list[list[torch.Tensor]]] = [[] for _ in range(world)]
    for s in range(steps):
        for r in range(world):
            opts[r].zero_grad()
            mse(models[r], *batch(r, s)).backward()
            opts[r].step()
        if (s + 1) % interval == 0:  # TF: local_step incremented first, then tested
            plists = [list(m.parameters()) for m in models]
            for group in zip(*plists, strict=True):
                _mean_(list(group))
                _mean_([opts[r].state[group[r]]["momentum_buffer"] for r in range(world)])
            blists = [[b for b in m.buffers() if b.is_floating_point()] for m in models]
            for group in zip(*blists, strict=True):
                _mean_(list(group))
        for r in range(world):
            traj[r].append(snapshot(models[r], opts[r]))
    return traj


def simulate_easgd(world: int, tau: int, steps: int, opt_fn, lr: float) -> dict:
    """EASGD with TF defaults: alpha = 0.9 / (tau * world), rho = alpha / lr."""
    alpha = 0.9 / tau / world  # TF: BETA / communication_period / num_worker
    rho = alpha / lr
    base = make_mlp(100)  # rank 0's initial model
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [opt_fn(list(m.parameters()), lr) for m in models]
    centre = [p.detach().clone() for p in base.parameters()]
    local_centre = [[c.clone() for c in centre] for _ in range(world)]
    traj: list[list[list[torch.Tensor]]] = [[] for _ in range(world)]
    centres = []
    for s in range(steps):
        for r in range(world):
            params = list(models[r].parameters())
            grads = torch.autograd.grad(mse(models[r], *batch(r, s)), params)
            for p, g, c in zip(params, grads, local_centre[r], strict=True):
                p.grad = g + rho * (p.detach() - c)
            opts[r].step()
        if (s + 1) % tau == 0:
            diffs = []
            for r in range(world):
                local_centre[r] = [c.clone() for c in centre]
                d = [p.detach() - c for p, c in zip(models[r].parameters(), centre, strict=True)]
                with torch.no_grad():
                    for p, di in zip(models[r].parameters(), d, strict=True):
                        p -= alpha * di
                diffs.append(d)
            for i, c in enumerate(centre):
                c += alpha * torch.stack([d[i] for d in diffs]).sum(0)
        for r in range(world):
            traj[r].append([p.detach().clone() for p in models[r].parameters()])
        centres.append([c.clone() for c in centre])
    return {"traj": traj, "centres": centres, "global_step": world * (steps // tau)}
