"""A job whose program never calls ``close()`` (run by torchrun, 2 ranks), with the wrapper
named by the first argument: ``sync-replicas`` (R = N, shards on both ranks, the model given:
read-ahead and streamed reads, a loop until ``last_step``) or ``easgd-async`` (the centre on a
server rank, 20 steps).  Each rank prints its step count and ends as a script ends."""

from __future__ import annotations

import sys

import torch
from torch import nn

import gradfleet.distributed as gfd

STEPS = 20

info = gfd.init(backend="gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 10))  # fmt: skip
if sys.argv[1] == "sync-replicas":
    opt = gfd.SyncReplicasOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3), 2, 2, last_step=STEPS,
        server_ranks=[0, 1], model=model, host="127.0.0.1",
    )  # fmt: skip
else:
    opt = gfd.ElasticAverageOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-2), 2, communication_period=2, mode="async"
    )
generator = torch.Generator().manual_seed(info.rank)
counter = "global_step" if sys.argv[1] == "sync-replicas" else "local_step"
while getattr(opt, counter) < STEPS:
    x = torch.randn(32, 64, generator=generator)
    y = torch.randint(0, 10, (32,), generator=generator)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(f"rank {info.rank} made {STEPS} steps", flush=True)
