"""Rank functions for the membership tests: a server rank that closes before a slow worker
said hello (run by ``run_ranks``)."""

from __future__ import annotations

import time

import torch

import gradfleet
from gradfleet.distributed import AsyncCentre, ElasticAverageOptimizer, SyncReplicasOptimizer
from gradfleet.distributed.easgd import async_centre
from gradfleet.distributed.sync.worker import shard_clients
from gradfleet.distributed.testing import RankContext
from gradfleet.distributed.transport import MailboxClient

HELLO_DELAY = 2.0


class SlowClient(MailboxClient):
    """A worker that is slow to connect (a loaded machine, a slow import)."""

    def __init__(self, *args, **kwargs) -> None:
        time.sleep(HELLO_DELAY)
        super().__init__(*args, **kwargs)


def close_before_hello(ctx: RankContext, wrapper: str) -> dict:
    """Rank 0 hosts the server and closes right after construction; rank 1 connects
    ``HELLO_DELAY`` seconds late, steps once and leaves.  Returns how long rank 0's close
    took and whether rank 1 could step."""
    if ctx.rank == 1:
        shard_clients.MailboxClient = async_centre.MailboxClient = SlowClient
    x = torch.zeros(3, requires_grad=True)
    inner = gradfleet.GradientDescentOptimizer([x], 0.5)
    if wrapper == "sync":
        opt = SyncReplicasOptimizer(inner, 1, 2, timeout=30, transport="server")
    else:
        opt = ElasticAverageOptimizer(inner, 2, 1, mode=AsyncCentre(timeout=30))
    start = time.monotonic()
    if ctx.rank == 1:
        x.grad = torch.ones(3)
        opt.step()
    opt.close()
    return {"close_s": time.monotonic() - start, "x": x.detach().tolist()}
