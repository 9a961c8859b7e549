"""The strategies the cluster benchmark compares, one small class each, on the public API only.

Every strategy trains the same model with the same wrapped optimizer (Adam) and answers:

* ``train_step(x, y) -> loss``: forward, backward and whatever communication it does;
* ``transfer_step()``: the communication of one update without forward/backward (run on zero
  gradients, which leave Adam's parameters unchanged), for the transfer-only time;
* ``updates()``: model updates so far -- the global step for synchronous schemes, the local
  step for ModelAverage and EASGD (every local step updates the model);
* ``close()``.

Extension point: decorate a subclass of :class:`Strategy` with ``@register("name")`` and add a
row to ``benchmarks.cluster.rows``.  ``Context.server_ranks`` are the ranks of the hosts that
only serve (dedicated servers: ``cluster_worker.serve_row``), after the workers' ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradfleet.distributed as gfd

STRATEGIES: dict[str, type[Strategy]] = {}
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def add(cls: type[Strategy]) -> type[Strategy]:
        STRATEGIES[name] = cls
        return cls

    return add


@dataclass
class Context:
    """Where this worker sits in the emulated cluster."""

    rank: int
    world: int  # worker ranks 0 .. world-1 (dedicated server ranks come after them)
    host: int  # this process's host index
    host_of_rank: list[int]  # host index of every rank
    address: str  # this host's address (servers listen on it)
    fast_hosts: list[int]  # hosts whose link is not slowed: where servers go
    timeout: float = 120.0
    server_ranks: list[int] = field(default_factory=list)  # dedicated servers' ranks

    def rank_on(self, host: int) -> int:
        return self.host_of_rank.index(host)


class Strategy:
    """Purely local training: the compute-only reference (no communication at all)."""

    def __init__(self, ctx: Context, model: nn.Module, lr: float, **options: Any) -> None:
        self.ctx, self.model, self.options = ctx, model, options
        self.opt = self.wrap(torch.optim.Adam(model.parameters(), lr=lr))
        self._local = 0

    def wrap(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return opt

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.loss(x, y)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.communicate()
        self.opt.step()
        self._local += 1
        return float(loss.detach())

    def communicate(self) -> None:
        """Between backward and the optimizer step (gradient all-reduce)."""

    def transfer_step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.communicate()
        self.opt.step()
        self._local += 1

    def updates(self) -> int:
        return self._local

    def close(self) -> None:
        pass


register("compute")(Strategy)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


@register("allreduce")
class AllReduce(Strategy):
    """Plain gloo all-reduce of every gradient after backward (no overlap), then the mean."""

    def communicate(self) -> None:
        for g in _grads(self.model):
            dist.all_reduce(g)
            g.div_(self.ctx.world)


@register("ddp")
class DDP(Strategy):
    """torch DDP: 25 MB buckets all-reduced asynchronously while backward runs (the anchor).
    Its transfer-only step all-reduces the same bytes in the same buckets, without backward."""

    def __init__(self, ctx: Context, model: nn.Module, lr: float, **options: Any) -> None:
        self.ddp = nn.parallel.DistributedDataParallel(model)
        super().__init__(ctx, model, lr, **options)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.ddp(x), y)

    def transfer_step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        bucket: list[torch.Tensor] = []
        for g in reversed(_grads(self.model)):  # DDP's order: roughly the order of backward
            bucket.append(g)
            if sum(t.numel() * t.element_size() for t in bucket) >= DDP_BUCKET_BYTES:
                self._reduce(bucket)
                bucket = []
        if bucket:
            self._reduce(bucket)
        self.opt.step()
        self._local += 1

    def _reduce(self, bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat)
        flat.div_(self.ctx.world)


@register("sync-replicas")
class SyncReplicas(Strategy):
    """``SyncReplicasOptimizer``; ``servers="default"`` (no server named: the quick start's
    layout, all-reduce for R = N), ``"one"`` (on host 0), ``"sharded"`` (one shard per
    fast host, so a slow link never serves) or ``"dedicated"`` (one shard per dedicated
    server rank); ``R`` gradients per update of N = world; ``overlap``, ``nonfinite`` and
    ``assignment`` (``shard_assignment``) as the optimizer's (``auto``: left out, the model
    given: laid out for the job); ``stream``: the reads stream into
    the next forward (``stream_reads``); ``per_rank``: shards per server
    rank (``server_ranks`` repeated), whose values travel back while later shards' gradients
    still go out (read-ahead, paced pushes)."""

    def wrap(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        ctx, o = self.ctx, self.options
        servers = o.get("servers", "one")
        job = {
            "replicas_to_aggregate": "auto" if o.get("R") == "auto" else int(o.get("R", ctx.world)),
            "total_num_replicas": ctx.world,
            "timeout": ctx.timeout,
            "last_step": int(o["last_step"]),
            "host": ctx.address,
        }
        if servers == "default":  # the quick start: no server named, every option left out
            self.sync = gfd.SyncReplicasOptimizer(opt, **job)
            return self.sync
        if servers == "dedicated":
            ranks = list(ctx.server_ranks)
        else:
            hosts = [ctx.fast_hosts[0]] if servers == "one" else ctx.fast_hosts
            ranks = [ctx.rank_on(h) for h in hosts]
        ranks = ranks * int(o.get("per_rank", 1))
        self.sync = gfd.SyncReplicasOptimizer(
            opt,
            **job,
            server_ranks=ranks,
            overlap=bool(o.get("overlap", False)),
            nonfinite=str(o.get("nonfinite", "raise")),
            shard_assignment=None if o.get("auto") else str(o.get("assignment", "bytes")),
            model=self.model if o.get("auto") else None,
        )
        if o.get("stream"):
            self.sync.stream_reads(self.model)
        return self.sync

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.loss(x, y)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def transfer_step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.opt.step()
        self.sync.wait_reads()  # streamed: no forward follows to wait for the values

    def updates(self) -> int:
        return int(self.sync.global_step)

    def close(self) -> None:
        self.sync.close()


@register("easgd-async")
class AsyncEasgd(Strategy):
    """Asynchronous EASGD, the centre on host 0's rank (``centre="dedicated"``: on the first
    dedicated server rank); an exchange every ``period`` steps."""

    def wrap(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        ctx = self.ctx
        dedicated = self.options.get("centre") == "dedicated"
        rank = ctx.server_ranks[0] if dedicated else ctx.rank_on(ctx.fast_hosts[0])
        centre = gfd.AsyncCentre(server_rank=rank, timeout=ctx.timeout, host=ctx.address)
        self.period = int(self.options.get("period", 4))
        return gfd.ElasticAverageOptimizer(
            opt, ctx.world, self.period, rho=float(self.options.get("rho", 0.1)), mode=centre
        )

    def communicate(self) -> None:
        self.opt.add_elastic_penalty_()

    def close(self) -> None:
        self.opt.close()


@register("model-average")
class ModelAverage(Strategy):
    """``ModelAverageOptimizer``: local steps, an exact all-reduce mean every ``interval``."""

    def wrap(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        interval = int(self.options.get("interval", 8))
        return gfd.ModelAverageOptimizer(opt, self.ctx.world, interval)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
