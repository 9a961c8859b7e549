"""Train a small classifier with each distributed wrapper, launched by torchrun.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/distributed_wrappers.py --steps 40

(``torchrun`` is the same program; on several machines use ``--nnodes`` and a rendezvous
endpoint instead of ``--standalone``.) Without torchrun it runs as a world of one process.

Each rank trains on its own shard of a synthetic two-spirals-like dataset:

1. ModelAverageOptimizer: SGD+momentum, exact averaging every 5 steps, BatchNorm statistics and
   momentum averaged too; afterwards every replica is bitwise identical.
2. ElasticAverageOptimizer: gradfleet's TF-exact Adam, TF's default moving rate, rho=0; the
   centre is exported under the model's own parameter names and evaluated in a plain model.
3. TowerOptimizer + replicate_model: inside each process, the batch is split over two towers
   (two CPU "devices" here, GPUs when there are several) and one optimizer step is taken.

The script exits non-zero if training does not learn or replicas disagree.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn

import gradfleet as gf
from gradfleet.distributed import (
    ElasticAverageOptimizer,
    ModelAverageOptimizer,
    TowerOptimizer,
    init,
    replicate_model,
    shutdown,
)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved noisy rings: class = which ring."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (n,), generator=g)
    angle = torch.rand(n, generator=g) * 6.2832
    radius = 1.0 + label.float() + 0.2 * torch.randn(n, generator=g)
    x = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return x, label


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def batches(rank: int, steps: int, size: int = 64):
    x, y = make_data(steps * size, seed=10 + rank)  # each rank has its own shard
    return [(x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]) for i in range(steps)]


def max_replica_gap(tensors: list[torch.Tensor]) -> float:
    """Largest difference between this rank's tensors and rank 0's (0.0 means identical)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    gap = (flat - ref).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return gap.item()


def train_model_average(rank: int, world: int, steps: int, x_test, y_test) -> float:
    model = make_model(seed=rank)  # deliberately different: the wrapper broadcasts rank 0's
    opt = ModelAverageOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        num_worker=world,
        interval_steps=5,
        buffers=model.buffers(),
        average_optimizer_state=True,
    )
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches(rank, steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    gap = max_replica_gap(list(model.state_dict().values()))
    if steps % 5 == 0 and gap != 0.0:
        raise SystemExit(f"ModelAverage replicas differ after the last round: {gap}")
    return accuracy(model, x_test, y_test)


def train_easgd(rank: int, world: int, steps: int, x_test, y_test) -> float:
    model = make_model(seed=rank)
    inner = gf.AdamOptimizer(model.parameters(), 0.02)
    # TF's default rho = moving_rate / lr sizes the penalty for SGD (rho * lr = moving_rate);
    # Adam normalises gradients, so that penalty would pin x to the centre: use rho=0 (TF's
    # own advice for asynchronous training) and rely on the elastic exchange every 2 steps.
    opt = ElasticAverageOptimizer(inner, num_worker=world, communication_period=2, rho=0.0)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches(rank, steps):
        opt.minimize(lambda x=x, y=y: loss_fn(model(x), y))  # loss + elastic penalty
    gap = max_replica_gap(opt.centre())
    if gap != 0.0:
        raise SystemExit(f"EASGD centre differs between ranks: {gap}")
    plain = make_model(seed=123)  # an ordinary model, loaded with the centre
    plain.load_state_dict(opt.swapping_state_dict(model))
    return accuracy(plain, x_test, y_test)


def train_towers(rank: int, steps: int, x_test, y_test) -> float:
    model = make_model(seed=0)
    opt = TowerOptimizer(lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loss_fn = nn.CrossEntropyLoss()

    def model_fn(tower: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(tower(x), y)
        opt.minimize(loss)  # each tower's loss is scaled by 1/T (MEAN reduction)
        return loss

    n_gpu = torch.cuda.device_count()
    devices = [f"cuda:{i}" for i in range(n_gpu)] if n_gpu > 1 else ["cpu", "cpu"]
    if n_gpu > 1:
        model.to(devices[0])
    step = replicate_model(model_fn, model, loss_reduction="mean", devices=devices)
    for x, y in batches(rank, steps):
        step(x, y)
    reference = copy.deepcopy(model).cpu()
    return accuracy(reference, x_test, y_test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--min-accuracy", type=float, default=0.8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    info = init(timeout=60)
    x_test, y_test = make_data(1000, seed=999)
    results = {
        "model_average": train_model_average(
            info.rank, info.world_size, args.steps, x_test, y_test
        ),
        "elastic_average": train_easgd(info.rank, info.world_size, args.steps, x_test, y_test),
        "towers": train_towers(info.rank, args.steps, x_test, y_test),
    }
    for name, acc in results.items():
        print(f"rank {info.rank}/{info.world_size} {name}: test accuracy {acc:.3f}", flush=True)
    shutdown()
    failed = [name for name, acc in results.items() if acc < args.min_accuracy]
    if failed:
        raise SystemExit(f"accuracy below {args.min_accuracy} for {failed}")


if __name__ == "__main__":
    main()
