"""Rank functions for test_strategy_adapters.py (importable by the ranks ``run_ranks`` starts):
each builds a table strategy's adapter on a small float64 MLP with Adam and drives it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradfleet.cli.strategy_table import TABLE

LR, WIDTH, INPUTS, CLASSES = 0.05, 8, 6, 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(INPUTS, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(5, INPUTS, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (5,), generator=gen)


def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(m(x), y)


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def drive(ctx: Any, configs: list[tuple[str, dict, int, int]]) -> list[dict]:
    """For each ``(name, args, transfers, steps)``: ``transfers`` transfer-only steps, then
    ``steps`` training steps on this rank's batches; the parameters after each phase, the
    updates counted after each step, and what the sync-replicas wrapper was built as."""
    out = []
    for name, args, transfers, steps in configs:
        m = model()
        strategy = TABLE[name].adapter(dict(args), ctx.rank, ctx.world_size)
        strategy.setup(m, torch.optim.Adam(m.parameters(), lr=LR))
        record: dict = {"start": _params(m), "updates": []}
        local = 0
        for _ in range(transfers):
            strategy.transfer_step()
            local += 1
            record["updates"].append(strategy.updates(local))
        record["after_transfer"] = _params(m)
        for step in range(steps):
            strategy.train_step(*batch(ctx.rank, step), loss_fn)
            local += 1
            record["updates"].append(strategy.updates(local))
        if name == "sync-replicas":
            opt = strategy.opt
            record.update(streaming=opt.streaming, server_ranks=list(opt.server_ranks))
            record.update(overlap=opt.overlap)
            opt.wait_reads()
        record["final"] = _params(m)
        strategy.finish()
        strategy.close()
        out.append(record)
    return out


def build_error(ctx: Any, args: dict) -> str:
    """The ValueError building a sync-replicas adapter with ``args`` raises (every rank alike,
    before any server starts)."""
    m = model()
    strategy = TABLE["sync-replicas"].adapter(dict(args), ctx.rank, ctx.world_size)
    try:
        strategy.setup(m, torch.optim.Adam(m.parameters(), lr=LR))
    except ValueError as err:
        return str(err)
    strategy.finish()
    return ""
