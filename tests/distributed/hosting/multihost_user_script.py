"""A user's own training script: a wrapper with a server, constructed without ``host=``.

Run with one torchrun per host; prints one JSON line with the rank, the server address and
the final parameters."""

from __future__ import annotations

import json
import sys

import torch

import gradfleet
from gradfleet.distributed import (
    AsyncCentre,
    ElasticAverageOptimizer,
    SyncReplicasOptimizer,
    init,
    shutdown,
)


def main(wrapper: str) -> None:
    info = init()
    x = torch.zeros(4, requires_grad=True)
    inner = gradfleet.GradientDescentOptimizer([x], 0.1)
    if wrapper == "sync":
        # R=1: nobody waits at the end
        opt = SyncReplicasOptimizer(inner, 1, 2, timeout=60, transport="server")
        address = opt.server_address
    else:
        centre = AsyncCentre(timeout=60)
        opt = ElasticAverageOptimizer(inner, 2, 2, mode=centre)
        address = centre.address
    for _ in range(6):
        x.grad = torch.full((4,), float(info.rank + 1))
        opt.step()
    opt.close()
    print(json.dumps({"rank": info.rank, "address": address, "x": x.tolist()}), flush=True)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
