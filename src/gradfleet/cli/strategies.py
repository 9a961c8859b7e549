"""Distribution strategies: one small adapter per strategy around gradfleet.distributed. Each
belongs to its entry of :data:`.strategy_table.TABLE` (``StrategyInfo.adapter``), which also
says what the strategy takes and checks it.

An adapter wraps the optimizer (``setup``), runs one training step (``train_step``) or one
update's communication alone (``transfer_step``), counts the bytes this worker hands to
collectives, and says what to save as "the model" (for EASGD, the centre). Strategies are named
on the command line as ``NAME[:key=value,...]``; the benchmarks build their strategies with
these same adapters, through the table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradfleet.distributed as gfd
from gradfleet.distributed.hosting.dedicated import CENTRE, SYNC
from gradfleet.distributed.transport.all_reduce import mean_gradients
from gradfleet.distributed.transport.collectives import TorchCollective

__all__ = [
    "DDP_BUCKET_BYTES",
    "DEFAULT_RHO",
    "DDP",
    "AllReduce",
    "Easgd",
    "ModelAverage",
    "Strategy",
    "SyncReplicas",
    "Towers",
    "easgd_modes",
]

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


def _nbytes(t: torch.Tensor) -> int:
    if t.is_sparse:
        return _nbytes(t._indices()) + _nbytes(t._values())
    return t.numel() * t.element_size()


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Strategy:
    """Base adapter: plain local training. ``bytes_sent`` counts this worker's payload."""

    def __init__(self, args: dict[str, Any], rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.bytes_sent = 0
        self.straggle_s = 0.0

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.model, self.opt = model, opt
        return opt

    @property
    def forward_model(self) -> nn.Module:
        """What the training step's forward runs (the model, or a wrapper around it)."""
        return self.model

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> float:
        if self.straggle_s:
            time.sleep(self.straggle_s)
        self.opt.zero_grad()
        loss = loss_fn(self.forward_model, x, y)
        loss.backward()
        self.apply_gradients()
        return float(loss.detach())

    def apply_gradients(self) -> None:
        """One update from the gradients in the parameters' ``.grad``, as a training step
        makes it after backward (the data-plane benchmark's step on fixed gradients)."""
        self.reduce_gradients()
        self.opt.step()

    def transfer_step(self) -> None:
        """One update's communication without forward and backward, on zero gradients (which
        leave Adam's parameters where they are while its moments are zero): the cluster
        benchmark's transfer-only time."""
        self._zero_gradients()
        self.apply_gradients()

    def _zero_gradients(self) -> None:
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()

    def reduce_gradients(self) -> None:
        return None

    def updates(self, local_step: int) -> int:
        """Model updates so far (the loop runs until ``--steps`` of them)."""
        return local_step

    def leader(self) -> int:
        """The rank that writes the run's files (metrics, checkpoints' pointer, summary, the
        model): rank 0, or the lowest live one where every rank holds the whole state."""
        return 0

    def server_state(self, rank: int) -> dict[str, Any] | None:
        """The checkpoint of dedicated server ``rank``, lost, where a standby holds its state
        now (what that server's ``state_dict()`` would have been); None where none does."""
        return None

    def stand_in(self, rank: int, state: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint file of worker ``rank``, lost, written by the leader from its own
        ``state`` so that ``--resume`` starts every rank again: the state a restarted worker
        rejoins with, a live peer's (its traffic counted from 0).  Only strategies that go on
        without a worker are asked."""
        return {**state, "bytes_sent": 0}

    def finish(self) -> None:
        """Collective end-of-training hook (every rank calls it)."""
        return None

    def export(self) -> dict[str, torch.Tensor]:
        """The model to save and evaluate."""
        return self.model.state_dict()

    def close(self) -> None:
        """Release the wrapper's threads and connections (every rank, after ``export``)."""
        return None

    #: Where a restarted worker finds the running job's server, or its shards' addresses
    #: (None: it cannot rejoin).
    server_address: str | list[str] | None = None

    def live_server_address(self) -> str | list[str] | None:
        """Where a restarted worker finds the servers now: :attr:`server_address`, or where
        a lost server's standby took over."""
        return self.server_address

    def live_server_ranks(self) -> list[int] | None:
        """The ranks hosting :meth:`live_server_address` now (None where not known)."""
        return None

    def lost_servers(self) -> list[int]:
        """The ranks of servers this worker found lost and moved off, to their standbys."""
        return []

    def forget(self, ranks: list[int]) -> None:
        """Rank 0: these workers are gone; the server stops waiting for them at the end."""
        return None


class AllReduce(Strategy):
    """Average gradients every step with gradfleet's all-reduce
    (:func:`gradfleet.distributed.transport.all_reduce.mean_gradients`): the dense ones summed
    and divided by the world size, each sparse row divided by the number of ranks that sent it
    -- the rule of SyncReplicas, so that ``compare`` sets the two strategies side by side on
    one average."""

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        params = [p.data for p in model.parameters()]
        for p in params:  # replicas start identical
            dist.broadcast(p, src=0)
        return super().setup(model, opt)

    def reduce_gradients(self) -> None:
        if self.world == 1:
            return
        params = list(self.model.parameters())
        means, sent = mean_gradients(params, [p.grad for p in params], owner="allreduce")
        self.bytes_sent += sent
        for p, g in zip(params, means, strict=True):
            p.grad = g


class DDP(Strategy):
    """torch's ``DistributedDataParallel`` (the cluster benchmark's reference, not offered by
    ``--strategy``): the mean gradient, all-reduced in :data:`DDP_BUCKET_BYTES` buckets while
    backward runs."""

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.ddp = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's model
        self._payload = sum(_nbytes(p) for p in model.parameters())
        return super().setup(model, opt)

    @property
    def forward_model(self) -> nn.Module:
        return self.ddp  # its backward hooks start the buckets' all-reduces

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> float:
        loss = super().train_step(x, y, loss_fn)
        self.bytes_sent += self._payload
        return loss

    def transfer_step(self) -> None:
        """The same bytes in the same buckets as DDP's backward, without backward."""
        self._zero_gradients()
        bucket: list[torch.Tensor] = []
        mean = TorchCollective().all_reduce_mean_
        for p in reversed(list(self.model.parameters())):  # DDP's order: about backward's
            bucket.append(p.grad)
            if sum(_nbytes(t) for t in bucket) >= DDP_BUCKET_BYTES:
                mean(bucket)
                bucket = []
        if bucket:
            mean(bucket)
        self.opt.step()


class ModelAverage(Strategy):
    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.interval = int(self.args.get("interval", 8))
        wrapped = gfd.ModelAverageOptimizer(opt, self.world, self.interval, buffers=model.buffers())
        self._payload = sum(_nbytes(p) for p in model.parameters())
        return super().setup(model, wrapped)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> float:
        loss = super().train_step(x, y, loss_fn)
        if self.world > 1 and self.opt.local_step % self.interval == 0:
            self.bytes_sent += self._payload
        return loss

    def finish(self) -> None:
        # Save the average, not rank 0's drift since the last round.
        if self.opt.local_step % self.interval != 0:
            self.opt.average()


DEFAULT_RHO = 0.1  # EASGD's elastic penalty unless rho= is given


def easgd_modes() -> dict[str, str]:
    """``easgd:mode=`` name -> ElasticAverageOptimizer mode, for the modes this build has."""
    modes = {"sync": "allreduce"}
    for name in gfd.CENTRE_MODES:
        if name != "allreduce":
            modes["async"] = name
    return modes


def _rho(value: Any) -> float | None:
    return None if value == "tf" else float(value)


class Easgd(Strategy):
    """Elastic averaging around a centre: all-reduced on every rank (``mode=sync``), or held by
    a centre server (``mode=async``: :attr:`centre`, its client, whose ``bytes_sent`` and
    ``counters()`` the benchmarks read; None in sync mode)."""

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from gradfleet.distributed import CENTRE_MODES

        self.period = int(self.args.get("period", 4))
        mode = easgd_modes()[self.args.get("mode", "sync")]
        self.centre = None
        if mode != "allreduce":  # the centre server: its interface, or the running job's
            self.centre = CENTRE_MODES[mode](
                # rank N: --servers 1; a restarted process: where the centre is now
                server_rank=int(self.args.get("live_server_rank", self.args.get("server_rank", 0))),
                timeout=float(self.args.get("timeout", 60.0)),
                host=self.args.get("host", "127.0.0.1"),
                address=self.args.get("server_address"),
                worker=self.args.get("worker"),
                standby=self.args.get("standby"),
            )
        wrapped = gfd.ElasticAverageOptimizer(
            opt,
            self.world,
            self.period,
            moving_rate=self.args.get("moving_rate"),
            rho=_rho(self.args.get("rho", DEFAULT_RHO)),
            mode=self.centre or mode,
        )
        self.server_address = getattr(self.centre, "address", None)
        self._payload = sum(_nbytes(p) for p in model.parameters())
        # exchanges cross processes with several workers, or with the centre on its own rank
        self._remote = self.world > 1 or int(self.args.get("server_rank", 0)) >= self.world
        return super().setup(model, wrapped)

    def reduce_gradients(self) -> None:
        # The elastic penalty rho * (x - centre): TF's minimize() path in a torch loop.
        self.opt.add_elastic_penalty_()

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> float:
        loss = super().train_step(x, y, loss_fn)
        if self._remote and self.opt.local_step % self.period == 0:
            self.bytes_sent += self._payload
        return loss

    def export(self) -> dict[str, torch.Tensor]:
        return self.opt.swapping_state_dict(self.model)

    def close(self) -> None:
        # Asynchronous mode: rank 0's centre server must stop before the interpreter exits
        # (its threads block inside the C++ store; left running they abort the process).
        self.opt.close()

    def forget(self, ranks: list[int]) -> None:
        if ranks and self.centre is not None:
            self.centre.forget_workers(ranks)

    def server_state(self, rank: int) -> dict[str, Any] | None:
        # the dedicated centre's rank was lost: its standby holds the centre, saved in the
        # server's own checkpoint format (what serve(state=) resumes from); written by the
        # rank that hosts it now (every worker moved, only one holds it)
        centre = self.centre
        if centre is None or centre.moved_from != rank or centre.server_rank != self.rank:
            return None
        return {"kind": CENTRE, "centre": centre.state_dict()["centre"]}

    def live_server_address(self) -> str | list[str] | None:
        # the centre's standby's address once it took over (None in sync mode)
        return getattr(self.centre, "address", None)

    def live_server_ranks(self) -> list[int] | None:
        return None if self.centre is None else [int(self.centre.server_rank)]

    def lost_servers(self) -> list[int]:
        moved = None if self.centre is None else self.centre.moved_from
        return [] if moved is None else [int(moved)]

    def leader(self) -> int:
        # the centre was on rank 0 and lives on another rank now (rank 0's host was lost, and
        # its standby took over; a rank 0 restarted since knows it from the rank it joined)
        if self.centre is not None and int(self.args.get("server_rank", 0)) == 0:
            now = int(self.centre.server_rank)
            if now != 0:
                return now
        return 0


class Towers(Strategy):
    """``world`` towers in this one process (threads), each on a slice of the batch, on the
    devices ``args["devices"]`` (the run's ``--device``; default every tower on the CPU)."""

    def __init__(self, args: dict[str, Any], rank: int, world: int) -> None:
        super().__init__(args, rank, world)
        self.towers, self.world = world, 1  # one process: no collectives

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        wrapped = gfd.TowerOptimizer(opt)
        self._grad_bytes = sum(_nbytes(p) for p in model.parameters())
        self.straggler_tower: int | None = None
        self._replicated: Any = None
        return super().setup(model, wrapped)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> float:
        def tower_fn(module: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            from gradfleet.distributed import current_tower

            if self.straggle_s and current_tower()[1] == self.straggler_tower:
                time.sleep(self.straggle_s)
            loss = loss_fn(module, xs, ys)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            return loss

        if self._replicated is None:  # replicas are built once, then kept in sync by gfd
            devices = self.args.get("devices", ["cpu"] * self.towers)
            self._replicated = gfd.replicate_model(tower_fn, self.model, "mean", devices)
        out = self._replicated(x, y)
        # Gradients of T-1 towers merged into the shared copy, parameters copied back.
        self.bytes_sent += 2 * (self.towers - 1) * self._grad_bytes
        return float(out.loss.detach())


def _replicas(value: Any) -> int | str:
    """``replicas_to_aggregate``: an int, or ``"auto"`` (chosen per update)."""
    return value if value == "auto" else int(value)


class SyncReplicas(Strategy):
    """Backup workers: the server applies the first ``replicas_to_aggregate`` fresh gradients
    of each round and drops late ones; the run ends once the server reached ``steps`` updates,
    so a straggler's remaining steps return at once.

    Besides the table's arguments, the launcher's: ``last_step``, ``timeout``, ``host``,
    ``server_ranks``, ``server_address`` and ``worker``; and the cluster benchmark's:
    ``nonfinite`` (the wrapper's, default ``"raise"``), ``with_model`` (default true: the
    model is given, to lay the shards out for the job and stream reads ahead; false: left
    out) and ``stream_reads`` (true: ``stream_reads(model)`` after construction)."""

    def setup(self, model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        total = int(self.args.get("total_num_replicas", self.world))
        ranks = self.args.get("server_ranks")  # dedicated ranks (--servers)
        if ranks is None and int(self.args.get("shards", 1)) > 1:
            ranks = [k % total for k in range(int(self.args["shards"]))]
        elif ranks is None and "shards" in self.args:
            ranks = [0]  # shards=1 asks for the one server on rank 0
        wrapped = gfd.SyncReplicasOptimizer(  # type: ignore[attr-defined]
            opt,
            replicas_to_aggregate=_replicas(self.args.get("replicas_to_aggregate", self.world - 1)),
            total_num_replicas=total,
            timeout=float(self.args.get("timeout", 60.0)),
            last_step=int(self.args["last_step"]) if "last_step" in self.args else None,
            num_tokens=int(self.args.get("num_tokens", -1)),
            tokens=self.args.get("tokens"),
            transport=self.args.get("transport"),
            overlap=self.args.get("overlap"),
            host=self.args.get("host", "127.0.0.1"),
            server_address=self.args.get("server_address"),
            worker=self.args.get("worker"),
            server_ranks=ranks,
            shard_assignment=self.args.get("shard_assignment"),
            nonfinite=self.args.get("nonfinite", "raise"),
            model=model if self.args.get("with_model", True) else None,
            max_losses=int(self.args["max_losses"]) if "max_losses" in self.args else None,
            hear_every_worker=self.args.get("hear_every_worker", True),
            standby=self.args.get("standby"),
        )
        if self.args.get("stream_reads"):
            wrapped.stream_reads(model)
        out = super().setup(model, wrapped)
        self.server_address = self.live_server_address()
        return out

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> float:
        loss = super().train_step(x, y, loss_fn)
        self.bytes_sent = int(self.opt.bytes_sent)  # the wrapper's own counter
        return loss

    def transfer_step(self) -> None:
        super().transfer_step()
        self.opt.wait_reads()  # streamed: no forward follows to wait for the values

    def updates(self, local_step: int) -> int:
        return int(self.opt.global_step)

    def live_server_address(self) -> str | list[str] | None:
        # the exchange's (a lost server's standby's once it took over); sharded (--servers
        # K > 1): a rejoining worker needs every shard's address; none without a server
        addresses = list(self.opt.exchange.server_addresses)
        return addresses if len(addresses) > 1 else (addresses or [None])[0]

    def live_server_ranks(self) -> list[int] | None:
        clients = getattr(self.opt.exchange, "clients", None)
        return None if clients is None else [int(r) for r in clients.ranks]

    def lost_servers(self) -> list[int]:
        clients = getattr(self.opt.exchange, "clients", None)
        return [] if clients is None else sorted({int(r) for r in clients.moved.values()})

    def leader(self) -> int:
        # the chief was on rank 0 and lives on another rank now (rank 0's host was lost, and
        # its standby took over; a rank 0 restarted since knows it from the ranks it joined):
        # that rank writes; all-reduce with max_losses: rank 0 may be gone
        chief = self.opt.chief_rank
        if chief is not None and chief != 0 and int(self.args.get("server_rank", 0)) == 0:
            return int(chief)
        return min(self.opt.live_workers)

    def server_state(self, rank: int) -> dict[str, Any] | None:
        # a dedicated server's rank was lost: the standby here holds its chief or shard, saved
        # in the server's own checkpoint format (what serve(state=) resumes from)
        chief = self.opt.standby_chief
        if self.opt.chief_moved_from == rank and chief is not None:
            return {"kind": SYNC, "server": chief.state_dict(), "shards": {}}
        servers = getattr(self.opt.exchange, "servers", None)
        shards = {} if servers is None else servers.standby_shards
        held = {
            k: server.shard.state_dict()
            for k, (server, hosted) in shards.items()
            if hosted.took_over and servers.ranks[k] == rank
        }
        return {"kind": SYNC, "server": None, "shards": held} if held else None

    def finish(self) -> None:
        # the R of every update, for the summary (the chief's record: ask before leaving)
        self.replicas_history = self.opt.replicas_history()
        # who was heard: each worker's gradients the chief took into updates, and dropped
        counts = self.opt.worker_counters()
        self.gradients_per_worker = {int(r): dict(c) for r, c in sorted(counts.items())}
        self.membership_changes = self.opt.membership_changes  # max_losses: the group's record
        self.opt.close()

    def forget(self, ranks: list[int]) -> None:
        if ranks:
            self.opt.forget_workers(ranks)
