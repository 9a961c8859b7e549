"""Rank functions for the FSDP2 / DDP / ZeRO tests (importable by ``run_ranks``).

Every rank computes its own unsharded single-process reference (the same model, the same
global batch, plain tensors, no collectives), so a rank's answer is checked against the
simulation in the same process.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.test_dtensor import CONCRETE, build

STEPS, MORE_STEPS = 3, 2
BATCH = 8


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 4, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows], y[rows]


def train(model, opt, steps, batches) -> None:
    for step in steps:
        x, y = batches(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def full_params(model) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def sharded(seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def fsdp_every_optimizer(ctx) -> dict:
    """Each optimizer on its default path: FSDP2 on 2 ranks vs one unsharded process; then
    the optimizer state round-trips through torch.distributed.checkpoint (saved to disk)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world = ctx.rank, ctx.world_size
    out = {}
    for i, cls in enumerate(CONCRETE):
        name = cls.__name__
        try:
            ref = make_model()
            ref_opt = build(cls, ref.parameters())
            train(ref, ref_opt, range(STEPS), global_batch)

            model = sharded()
            opt = build(cls, model.parameters())
            train(model, opt, range(STEPS), lambda s: local_batch(s, rank, world))
            trained = max(_diff(a, b) for a, b in zip(full_params(ref), full_params(model)))

            path = f"{ctx.workdir}/ckpt-{i}"
            dcp.save(
                {
                    "model": get_model_state_dict(model),
                    "optim": get_optimizer_state_dict(model, opt),
                },
                checkpoint_id=path,
            )
            fresh = sharded(seed=1)  # other weights: the checkpoint must overwrite them
            fresh_opt = build(cls, fresh.parameters())
            state = {
                "model": get_model_state_dict(fresh),
                "optim": get_optimizer_state_dict(fresh, fresh_opt),
            }
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(fresh, state["model"])
            set_optimizer_state_dict(fresh, fresh_opt, state["optim"])

            more = range(STEPS, STEPS + MORE_STEPS)
            train(ref, ref_opt, more, global_batch)
            train(model, opt, more, lambda s: local_batch(s, rank, world))
            train(fresh, fresh_opt, more, lambda s: local_batch(s, rank, world))
            resumed = max(_diff(a, b) for a, b in zip(full_params(model), full_params(fresh)))
            continued = max(_diff(a, b) for a, b in zip(full_params(ref), full_params(model)))
            out[name] = {"trained": trained, "resumed": resumed, "continued": continued}
        except Exception as exc:  # reported per optimizer; the others still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative difference (relative to max(1, |a|))."""
    return float(((a - b).abs() / a.abs().clamp_min(1.0)).max())


# Optimizers for the DDP/ZeRO runs: stateful with non-slot state, closed form, whole-tensor norm.
ENGINE_OPTIMIZERS = ("AdamOptimizer", "FtrlOptimizer", "NormalizedSGD", "MomentumOptimizer")


def ddp_and_zero(ctx) -> dict:
    """DDP with a gradfleet optimizer, and ZeroRedundancyOptimizer wrapping one (each rank
    steps the parameters it owns, then broadcasts them), vs one unsharded process."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = ctx.rank, ctx.world_size
    out = {}
    for cls in CONCRETE:
        if cls.__name__ not in ENGINE_OPTIMIZERS:
            continue
        ref = make_model()
        ref_opt = build(cls, ref.parameters())
        train(ref, ref_opt, range(STEPS), global_batch)
        for engine in ("ddp", "zero"):
            model = DDP(make_model())
            if engine == "ddp":
                opt = build(cls, model.parameters())
            else:
                opt = ZeroRedundancyOptimizer(
                    model.parameters(),
                    optimizer_class=cls,
                    **_constructor_arguments(cls),
                )
            train(model, opt, range(STEPS), lambda s: local_batch(s, rank, world))
            diff = max(_diff(a, b) for a, b in zip(full_params(ref), full_params(model)))
            out[f"{cls.__name__}/{engine}"] = diff
    return out


def _constructor_arguments(cls) -> dict:
    """The keyword arguments ``build`` gives ``cls`` (ZeRO constructs the optimizer)."""
    from tests.test_dtensor import _SPECS

    spec = _SPECS.get(cls)
    return dict(spec.configs[0]) if spec else {"learning_rate": 0.1}
