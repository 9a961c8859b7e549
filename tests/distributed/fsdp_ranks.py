"""Rank functions for the FSDP2 / DDP / ZeRO tests (importable by ``run_ranks``).

Every rank computes its own unsharded single-process reference (the same model, the same
global batch, plain tensors, no collectives), so a rank's answer is checked against the
simulation in the same process.
"""

from __future__ import annotations

import torch
from torch import nn

import gradfleet as gf
from tests.kernels.test_dtensor import CONCRETE, build

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
    from tests.kernels.test_dtensor import _SPECS

    spec = _SPECS.get(cls)
    return dict(spec.configs[0]) if spec else {"learning_rate": 0.1}


# --------------------------------------------------------------------- HSDP + local SGD
# 4 ranks on a 2x2 mesh: FSDP2 shards each replica over mesh["shard"] (2 ranks), and the
# wrapper averages across mesh["replicate"] (2 replica groups).  Replica r trains on
# sims.batch(r, step); each of its 2 shard ranks takes half of it.
HSDP_STEPS, INTERVAL, HSDP_LR = 6, 2, 0.05


def _hsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    from .sims import make_mlp

    model = make_mlp(100)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    return fully_shard(model, mesh=mesh["shard"])


def _half(replica: int, shard: int, step: int):
    from .sims import batch

    x, y = batch(replica, step)
    rows = slice(shard * 4, shard * 4 + 4)
    return x[rows], y[rows]


def hsdp_local_sgd(ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradfleet.distributed import ElasticAverageOptimizer, ModelAverageOptimizer

    from .sims import mse

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard = ctx.rank // 2, ctx.rank % 2
    group = mesh["replicate"].get_group()
    out = {}
    for wrapper in ("model_average", "easgd"):
        model = _hsdp_model(mesh)
        inner = gf.AdamOptimizer(model.parameters(), learning_rate=HSDP_LR)
        if wrapper == "model_average":
            opt = ModelAverageOptimizer(
                inner,
                num_worker=2,
                interval_steps=INTERVAL,
                average_optimizer_state=True,
                process_group=group,
            )
        else:
            opt = ElasticAverageOptimizer(
                inner, num_worker=2, communication_period=INTERVAL, process_group=group
            )
        traj = []
        for step in range(HSDP_STEPS):
            opt.zero_grad()
            mse(model, *_half(replica, shard, step)).backward()
            if wrapper == "easgd":
                opt.add_elastic_penalty_()
            opt.step()
            traj.append(full_params(model))
        out[wrapper] = traj
        if wrapper == "easgd":
            from torch.distributed.tensor import DTensor

            out["centre"] = [c.full_tensor() if isinstance(c, DTensor) else c for c in opt.centre()]
    out["wrong_group"] = _wrong_group_refused(mesh)
    return out


def _wrong_group_refused(mesh) -> str:
    """Averaging over the ranks that hold different shards of one replica is refused."""
    from gradfleet.distributed import ModelAverageOptimizer

    model = _hsdp_model(mesh)
    inner = gf.AdamOptimizer(model.parameters(), learning_rate=HSDP_LR)
    try:
        ModelAverageOptimizer(inner, num_worker=2, process_group=mesh["shard"].get_group())
    except ValueError as exc:
        return str(exc)
    return "accepted"


def simulate_hsdp_model_average() -> list[list[list[torch.Tensor]]]:
    """2 unsharded replicas, Adam, exact mean of parameters and slots every INTERVAL steps."""
    import copy

    from .sims import batch, make_mlp, mse

    models = [copy.deepcopy(make_mlp(100)) for _ in range(2)]
    opts = [gf.AdamOptimizer(m.parameters(), learning_rate=HSDP_LR) for m in models]
    traj: list[list[list[torch.Tensor]]] = [[], []]
    for step in range(HSDP_STEPS):
        for r in range(2):
            opts[r].zero_grad()
            mse(models[r], *batch(r, step)).backward()
            opts[r].step()
        if (step + 1) % INTERVAL == 0:
            pairs = list(zip(models[0].parameters(), models[1].parameters()))
            with torch.no_grad():
                for a, b in pairs:
                    tensors = [a, b] + [o.state[p][k] for o, p in zip(opts, (a, b)) for k in "mv"]
                    for group in ([a, b], tensors[2::2], tensors[3::2]):
                        mean = (group[0] + group[1]) / 2
                        for t in group:
                            t.copy_(mean)
        for r in range(2):
            traj[r].append([p.detach().clone() for p in models[r].parameters()])
    return traj
