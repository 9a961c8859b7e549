"""A cluster benchmark row's strategy, built from the CLI's strategy table and adapters
(:mod:`gradfleet.cli.strategy_table`, :mod:`gradfleet.cli.strategies`): what the benchmark
measures is what ``gradfleet train --strategy`` runs.

A row (``benchmarks.cluster.cluster.Row``) names its strategy and options in the benchmark's words:

* ``compute``: the table's ``none`` (each host trains alone: the compute-only reference);
* ``ddp``, ``allreduce``: the table's strategies of those names;
* ``sync-replicas``: ``R`` gradients per update of N = the worker hosts; ``servers``:
  ``"default"`` (no server named and every other option left out: the quick start's layout,
  all-reduce for R = N), ``"one"`` (default: a server on the first fast host), ``"sharded"``
  (one shard per fast host, so a slow link never serves) or ``"dedicated"`` (one shard per
  dedicated server rank), each rank ``per_rank`` times; ``overlap`` and ``nonfinite`` as the
  wrapper's; ``assignment``: ``shard_assignment`` (default ``"bytes"``); ``auto``: the
  assignment left out and the model given (laid out for the job); ``stream``: the reads
  stream into the next forward (``stream_reads``);
* ``easgd-async``: the table's ``easgd:mode=async``, ``period``, ``rho`` and ``standby`` as
  its; the centre on the first fast host's rank (``centre="dedicated"``: on the first
  dedicated server rank);
* ``model-average``: ``interval`` as the table's.

:func:`table_strategy` turns a row into the table's name and arguments, checked as the CLI
checks ``--strategy``; :func:`placement` adds the launcher's arguments (where the servers sit
in the emulated cluster); :class:`RowStrategy` drives the adapter through the benchmark's
phases.  ``steps_scale`` is the worker loop's (more updates for local-step rows), not the
strategy's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradfleet.cli.strategy_table import TABLE, validate_strategy

__all__ = ["ROW_OPTIONS", "Context", "RowStrategy", "placement", "table_strategy"]

# row strategy -> (the table's name, the options a row of it may give)
ROW_OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "compute": ("none", ()),
    "ddp": ("ddp", ()),
    "allreduce": ("allreduce", ()),
    "sync-replicas": (
        "sync-replicas",
        (
            "R",
            "servers",
            "per_rank",
            "overlap",
            "nonfinite",
            "assignment",
            "auto",
            "stream",
            "max_losses",
            "hear",
            "standby",
        ),
    ),
    "easgd-async": ("easgd", ("period", "rho", "centre", "standby")),
    "model-average": ("model-average", ("interval",)),
}
LOOP_OPTIONS = ("steps_scale",)  # the worker loop's, not the strategy's
SERVERS = ("default", "one", "sharded", "dedicated", "none")  # none: transport="allreduce"


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


def table_strategy(strategy: str, options: dict[str, Any], workers: int) -> tuple[str, dict]:
    """The table's strategy name and arguments of a row of ``workers`` worker hosts, checked
    by ``validate_strategy`` (ValueError naming what is wrong)."""
    if strategy not in ROW_OPTIONS:
        raise ValueError(f"row strategy {strategy!r} unknown; allowed: {', '.join(ROW_OPTIONS)}")
    name, allowed = ROW_OPTIONS[strategy]
    unknown = sorted(set(options) - set(allowed) - set(LOOP_OPTIONS))
    if unknown:
        raise ValueError(
            f"row strategy {strategy} takes no options {unknown}; allowed: "
            f"{', '.join(allowed + LOOP_OPTIONS)}"
        )
    o, args = options, {}
    if name == "sync-replicas":
        servers = o.get("servers", "one")
        if servers not in SERVERS:
            raise ValueError(f"sync-replicas servers={servers!r}; allowed: {', '.join(SERVERS)}")
        if servers == "default" and set(o) - {"R", "servers", "max_losses"}:
            raise ValueError(
                f"sync-replicas servers='default' leaves every other option but max_losses "
                f"out, got {sorted(set(o) - {'R', 'servers', 'max_losses'})}"
            )
        args = {"replicas_to_aggregate": o.get("R", workers), "total_num_replicas": workers}
        if servers == "default" and "max_losses" in o:  # the default exchange, losses allowed
            args["max_losses"] = int(o["max_losses"])
        if servers == "none":  # every rank keeps the state: the first R all-reduce
            args["transport"] = "allreduce"
            # given either way: the rows measured before losses were allowed by default
            args["max_losses"] = int(o.get("max_losses", 0))
            if "hear" in o:
                args["hear_every_worker"] = bool(o["hear"])
        elif servers != "default":
            args["overlap"] = bool(o.get("overlap", False))
            if "standby" in o:  # the chief's live standby (default: the library's rule)
                args["standby"] = bool(o["standby"])
                if o["standby"]:  # a copy of a server: the exchange with servers, named
                    args["transport"] = "server"
            if not o.get("auto"):  # auto: left out, laid out for the job from the model
                args["shard_assignment"] = o.get("assignment", "bytes")
    elif name == "easgd":
        args = {"mode": "async", **{k: o[k] for k in ("period", "rho", "standby") if k in o}}
    elif name == "model-average":
        args = {k: o[k] for k in ("interval",) if k in o}
    # compute: every host trains alone, a one-worker run of its own
    validate_strategy(name, args, 1 if name == "none" else workers, TABLE)
    return name, args


def placement(name: str, options: dict[str, Any], ctx: Context, last_step: int) -> dict:
    """The launcher's arguments of table strategy ``name`` for this worker: its servers' ranks
    and address, the timeout, the last update; and the benchmark's ``nonfinite``,
    ``stream_reads`` and ``with_model`` of a sync-replicas row."""
    o = options
    if name == "easgd":
        dedicated = o.get("centre") == "dedicated"
        rank = ctx.server_ranks[0] if dedicated else ctx.rank_on(ctx.fast_hosts[0])
        return {"server_rank": rank, "timeout": ctx.timeout, "host": ctx.address}
    if name != "sync-replicas":
        return {}
    args = {"last_step": last_step, "timeout": ctx.timeout, "host": ctx.address}
    servers = o.get("servers", "one")
    if servers in ("default", "none"):
        return {**args, "with_model": False}
    if servers == "dedicated":
        ranks = list(ctx.server_ranks)
    else:
        hosts = [ctx.fast_hosts[0]] if servers == "one" else ctx.fast_hosts
        ranks = [ctx.rank_on(h) for h in hosts]
    return {
        **args,
        "server_ranks": ranks * int(o.get("per_rank", 1)),
        "nonfinite": str(o.get("nonfinite", "raise")),
        "stream_reads": bool(o.get("stream", False)),
        "with_model": bool(o.get("auto", False)),
    }


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


class RowStrategy:
    """A row's table adapter as the benchmark's phases drive it: Adam on ``model`` (wrapped:
    ``opt``), a training step (``train_step``), an update's communication on zero gradients
    (``transfer_step``), ``updates()`` -- the global step for sync-replicas, else the local
    steps of both kinds (every local step updates the model) -- and ``close()`` (the adapter's
    end of training)."""

    def __init__(
        self,
        strategy: str,
        options: dict[str, Any],
        ctx: Context,
        model: nn.Module,
        lr: float,
        last_step: int,
    ) -> None:
        name, args = table_strategy(strategy, options, ctx.world)
        args.update(placement(name, options, ctx, last_step))
        self.adapter = TABLE[name].adapter(args, ctx.rank, 1 if name == "none" else ctx.world)
        self.adapter.setup(model, torch.optim.Adam(model.parameters(), lr=lr))
        self._local = 0

    @property
    def opt(self) -> torch.optim.Optimizer:
        """The optimizer the adapter steps (the strategy's wrapper around Adam, or Adam)."""
        return self.adapter.opt

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.adapter.train_step(x, y, _loss)
        self._local += 1
        return loss

    def transfer_step(self) -> None:
        self.adapter.transfer_step()
        self._local += 1

    def updates(self) -> int:
        return self.adapter.updates(self._local)

    def close(self) -> None:
        self.adapter.finish()
        self.adapter.close()
