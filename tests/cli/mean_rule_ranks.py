"""Rank functions for test_mean_rule.py (importable by the ranks ``run_ranks`` starts): the
same gradients averaged by the CLI's ``allreduce`` adapter and by SyncReplicas' all-reduce
exchange, each handing the averages to an optimizer that keeps what it is given."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradfleet.cli.strategy_table import TABLE
from gradfleet.distributed import SyncReplicasOptimizer

EMB_ROWS, DIM = 5, 2
SHAPES = {"emb": (EMB_ROWS, DIM), "bias": (3,), "weight": (2, 2), "unused": (2,)}
# the rows of each rank's sparse gradient of ``emb``: row 0 from one rank, row 1 from two,
# row 2 from all three (twice from rank 1: the duplicates sum), rows 3 and 4 from none
ROWS = {0: [0, 1, 2], 1: [1, 2, 2], 2: [2]}


def _dyadic(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/8 below 8 in magnitude: their sums are exact in any order, so the two
    paths, which lay the gradients out differently, must agree to the last bit."""
    return torch.randint(-64, 64, shape, generator=gen).to(torch.float64) / 8


def gradients(rank: int, mixed: bool = False) -> dict[str, torch.Tensor | None]:
    """Rank ``rank``'s gradients: ``emb`` row-sparse, ``bias`` dense on ranks 0 and 2 only,
    ``weight`` dense everywhere, ``unused`` on no rank.  ``mixed``: rank 0 sends ``weight``
    sparse while the others send it dense."""
    gen = torch.Generator().manual_seed(rank)
    rows = ROWS[rank]
    values = _dyadic(gen, len(rows), DIM)
    emb = torch.sparse_coo_tensor([rows], values, SHAPES["emb"], check_invariants=True)
    weight: torch.Tensor = _dyadic(gen, *SHAPES["weight"])
    if mixed and rank == 0:
        weight = weight.to_sparse(1)  # row-sparse, as an embedding's gradient
    bias = _dyadic(gen, *SHAPES["bias"]) if rank != 1 else None
    return {"emb": emb, "bias": bias, "weight": weight, "unused": None}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.float64)))


class Recorder(torch.optim.Optimizer):
    """Applies nothing; keeps the gradients each ``step()`` finds on its parameters."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self.seen: list[list[torch.Tensor | None]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        self.seen.append([None if p.grad is None else p.grad.clone() for p in params])


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def cli_allreduce(ctx: Any, mixed: bool) -> dict[str, Any]:
    """The CLI's ``allreduce`` adapter: its reduction, then the optimizer's step."""
    model = Model()
    strategy = TABLE["allreduce"].adapter({}, ctx.rank, ctx.world_size)
    recorder = Recorder(model.parameters())
    strategy.setup(model, recorder)
    for name, g in gradients(ctx.rank, mixed).items():
        getattr(model, name).grad = g
    error = _error(strategy.reduce_gradients)
    if error is None:
        strategy.opt.step()
    strategy.close()
    return {"seen": recorder.seen, "error": error}


def exchange_allreduce(ctx: Any, mixed: bool) -> dict[str, Any]:
    """SyncReplicas with R == N and no server named: the all-reduce exchange."""
    model = Model()
    recorder = Recorder(model.parameters())
    opt = SyncReplicasOptimizer(recorder, ctx.world_size, timeout=30)
    grads = gradients(ctx.rank, mixed)
    pairs = [(g, getattr(model, name)) for name, g in grads.items() if g is not None]
    global_step = torch.zeros((), dtype=torch.int64)
    error = _error(lambda: opt.apply_gradients(pairs, global_step))
    out = {"seen": recorder.seen, "error": error, "transport": opt.transport}
    opt.close()
    return out


def both(ctx: Any) -> dict[str, Any]:
    """Both paths, on the gradients of the rule's cases and then on the mixed ones."""
    return {
        "cli": cli_allreduce(ctx, mixed=False),
        "exchange": exchange_allreduce(ctx, mixed=False),
        "cli_mixed": cli_allreduce(ctx, mixed=True),
        "exchange_mixed": exchange_allreduce(ctx, mixed=True),
    }
