"""Dedicated server processes: ranks that only serve, as TF's ``ps`` tasks and BytePS's servers.

A job of ``N`` workers (ranks ``0 .. N-1``) and ``K`` dedicated servers (ranks ``N .. N+K-1``):
the workers build their wrapper as usual, naming the server ranks
(``SyncReplicasOptimizer(..., server_ranks=[N, ...])`` or ``AsyncCentre(server_rank=N)``); a
server rank calls :func:`serve` (or builds a :class:`ParameterServer`) instead of training.  The
server learns everything from the first worker, during the wrappers' construction (which every
rank of the job enters together):

1. rank 0 broadcasts the job's *spec*: which wrapper, its arguments (SyncReplicas: its whole
   :class:`~.sync.job.Job` and the layout's :class:`~.sync.layout.assignment.Placement`), the
   variables' shapes and dtypes and the wrapped optimizer's parameter groups;
2. every rank gathers every rank's status: a dedicated server that cannot serve that spec (no
   ``optimizer`` factory for SyncReplicas, a checkpoint of another layout) makes every rank
   raise the same error naming it, instead of a hang;
3. rank 0 sends each dedicated server the initial values of the variables it hosts (point to
   point on the process group's data plane; TF's chief initialises the ps variables);
4. the usual set-up follows: where servers listen, their addresses, every worker's hello.

A SyncReplicas server needs the wrapped optimizer: ``optimizer`` is a factory called with the
workers' parameter groups (``[{"params": [...], **hyperparameters}, ...]``, in the workers'
order) that returns the same kind of optimizer, e.g. ``lambda groups: torch.optim.Adam(groups)``.
Variables the server does not host are zero-size placeholders there.  Workers send their
numeric hyperparameters (``lr``, ``momentum``, ...) with a push whenever they changed, so an LR
schedule run on the workers also drives the dedicated servers.

A server serves until every worker left (``close()`` on the worker) or has been silent for the
wrapper's ``timeout`` seconds, then returns its state: ``state=`` restores such a state at the
start of the next job (a checkpoint per server rank, saved with ``torch.save``, loaded with
``torch.load(..., weights_only=True)``).
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..easgd.server.centre_server import CentreServer
from ..sync.layout.pieces import view, whole
from ..transport import MailboxClient
from .centre_standby import attach_centre_standby
from .dedicated import CENTRE, SYNC, check_statuses, receive_from_first
from .hosted_server import (
    HostedServer,
    env_server_host,
    gather_addresses,
    server_host,
    share_address,
)
from .server_directory import ServerDirectory, job_directory
from .standby import standby_rank, standby_ranks
from .sync_servers import SyncServers, start_standby

__all__ = ["ParameterServer", "serve"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


# ----------------------------------------------------------------------------- server side
class ParameterServer:
    """This rank's dedicated server: built collectively with the workers' wrappers (see the
    module docstring), serving on background threads.  :meth:`join` waits for the workers'
    end; :meth:`state_dict` is this server's checkpoint.

    Args:
        optimizer: factory of the wrapped optimizer (SyncReplicas; ignored for EASGD).
        host: interface to listen on (default as the wrappers': loopback on one host, else
            the address towards ``MASTER_ADDR``).
        state: a :meth:`state_dict` of the same server rank to resume from.
    """

    def __init__(
        self,
        optimizer: OptimizerFactory | None = None,
        *,
        host: str | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "serve: a dedicated server is a rank of the job: call "
                "gradfleet.distributed.init() (or init_process_group) first"
            )
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        self._fields(dist.get_rank(), box[0])
        try:
            tensors = self._prepare(optimizer, state)
            problem = None
        except Exception as exc:  # reported to every rank, then raised here too
            tensors = []
            problem = f"{type(exc).__name__}: {exc}"
            log.error("dedicated server rank %d: %s", self.rank, traceback.format_exc())
        check_statuses(problem)
        receive_from_first(tensors)
        self._start(host, state)

    def _fields(self, rank: int, spec: dict[str, Any]) -> None:
        self.rank, self.spec = rank, spec
        self.kind = spec.get("kind")
        self._sync: SyncServers | None = None
        self._centre: CentreServer | None = None
        self._hosted: HostedServer | None = None
        self._shards: dict[int, Any] = {}  # SyncReplicas shards hosted here (not the chief's)

    @classmethod
    def rejoin(
        cls,
        optimizer: OptimizerFactory | None,
        *,
        spec: dict[str, Any],
        address: str | Sequence[str],
        rank: int,
        host: str | None = None,
    ) -> ParameterServer:
        """This dedicated server rank restarted into its running job, outside the process
        group: the live standby of the server it was, which a standby on a worker rank took
        over when this rank was lost.  It serves an empty copy and asks that server, at
        ``address``, to take it as its standby; the server's first copy is its whole state (a
        live peer's, not a checkpoint), so a later loss of that server's host moves the
        workers here, as the first loss moved them off this rank.  ``spec``: what this rank
        served (the spec rank 0 announced; :meth:`spec` of the first process).  Refused
        (``RuntimeError``) where the server has a standby already or is gone.

        The EASGD centre, or SyncReplicas' servers: the chief of a job with one server, or
        with several (``--servers K``) every shard this rank served, each the standby of the
        server that took it over (``address``: every shard's address, the chief's first).
        A restarted shard server asks the chief where its standby is, so that its reports of
        updates go there if the chief is lost later, as the first process's did."""
        self = cls.__new__(cls)
        self._fields(rank, spec)
        host = host or env_server_host()
        if self.kind == CENTRE:
            values = [_empty(s, d) for s, d in spec["layout"]]
            client = MailboxClient(address, f"easgd-standby{rank}", spec["timeout"] + 10.0,
                                   "the EASGD centre", data=False)  # fmt: skip
            server, hosted = attach_centre_standby(
                client, values, num_worker=spec["num_worker"], timeout=spec["timeout"],
                host=host, name=f"EASGD centre (standby on dedicated rank {rank})", worker=-1,
                rank=rank,
            )  # fmt: skip
            self._centre, self._hosted = server, hosted
            return self
        placement, job = spec["placement"], spec["job"]
        addresses = [address] if isinstance(address, str) else list(address)
        mine = [k for k, r in enumerate(placement.ranks) if r == rank]
        if len(addresses) != len(placement.ranks) or not mine:
            raise RuntimeError(
                f"dedicated server rank {rank}: the job's servers are at {addresses}, its "
                f"spec has server_ranks={placement.ranks}: they do not fit"
            )
        self._values = _hosted_values(spec, rank)
        self._opt = _factory_optimizer(optimizer, spec["groups"], self._values)
        servers = SyncServers(
            self._opt, job, placement, rank, host,
            hyperparameters_from_workers=True, standby_of=mine,
            directory=_directory(spec, joining=True),
        )  # fmt: skip
        chief_standby = None if 0 in mine else _chief_standby(addresses[0], rank, job.timeout)
        taken = servers.rejoin(addresses, chief_standby)
        if sorted(taken) != mine:  # refused, or gone: SyncServers.rejoin logged why
            servers.close(time.monotonic())
            raise RuntimeError(
                f"dedicated server rank {rank}: the servers of shard(s) {mine} (0: the chief) "
                f"took its standby for {sorted(taken)} only"
            )
        self._sync = servers
        self._shards = {k: srv.shard for k, (srv, _) in servers.standby_shards.items()}
        return self

    # ------------------------------------------------------------------ set-up
    def _prepare(self, factory: OptimizerFactory | None, state: Any) -> list[torch.Tensor]:
        """Check the spec against this rank's arguments; the tensors to receive into."""
        spec = self.spec
        if self.kind == CENTRE:
            if spec["server_rank"] != self.rank:
                raise ValueError(f"the EASGD centre is on rank {spec['server_rank']}")
            self._values = [_empty(s, d) for s, d in spec["layout"]]
            if state is not None and state.get("kind") != CENTRE:
                raise ValueError(f"state= holds a {state.get('kind')!r} server, not {CENTRE}")
            return self._values
        if self.kind != SYNC:
            raise ValueError(f"rank 0 announced {self.kind!r}: nothing a server runs")
        self._values = _hosted_values(spec, self.rank)
        self._opt = _factory_optimizer(factory, spec["groups"], self._values)
        if state is not None:
            self._check_sync_state(state)
        # in the order rank 0 sends them (dedicated.announce): shard by shard
        return [view(self._values[pc.index], pc) for pc in _hosted_pieces(spec, self.rank)]

    def _check_sync_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != SYNC:
            raise ValueError(f"state= holds a {state.get('kind')!r} server, not {SYNC}")
        ranks = self.spec["placement"].ranks
        want = {k for k, r in enumerate(ranks) if r == self.rank and k}
        have = {int(k) for k in state.get("shards", {})}
        if have != want or (state.get("server") is None) != (ranks[0] != self.rank):
            raise ValueError(
                f"state= holds shards {sorted(have)} (chief: {state.get('server') is not None}), "
                f"this rank hosts {sorted(want)} (chief: {ranks[0] == self.rank}): load each "
                "server rank's own state, same server_ranks"
            )

    def _start(self, host: str | None, state: dict[str, Any] | None) -> None:
        spec = self.spec
        host = server_host(host, "serve")  # collective, as on the workers
        if self.kind == CENTRE:
            # as the workers' AsyncCentre.setup does, collective for collective
            workers = spec["num_worker"]
            standby = standby_rank(spec.get("standby"), self.rank, range(workers))
            self._centre = CentreServer(
                self._values, spec["num_worker"], spec["timeout"], keep_reads=standby is not None
            )
            if state is not None:
                for c, v in zip(self._centre.centre, state["centre"], strict=True):
                    c.copy_(v)
            self._hosted = HostedServer(self._centre, self._centre.members, host, "EASGD centre")
            share_address(self._hosted.address, self.rank)
            if standby is not None:  # a worker rank starts it from this centre, then tells
                self._hosted.forward_to(share_address(None, standby), standby, spec["timeout"])
                dist.barrier()  # no worker's hello before this server forwards
            return
        ranks, job = spec["placement"].ranks, spec["job"]
        standbys = standby_ranks(job.standby, ranks, range(job.N))  # as on the workers
        self._sync = SyncServers(
            self._opt, job, spec["placement"], self.rank, host,
            hyperparameters_from_workers=True, standbys=standbys,
            directory=_directory(spec, joining=False),
        )  # fmt: skip
        self._shards = {k: srv.shard for k, (srv, _) in self._sync.shards.items()}
        if state is not None:
            self._load_sync(state)
        mine = self._sync.addresses()
        if len(ranks) == 1:
            addresses = {0: share_address(mine.get(0), ranks[0])}
        else:
            addresses = gather_addresses(mine)
        self._sync.connect(addresses)
        start_standby(self._sync, standbys, addresses)

    def _load_sync(self, state: dict[str, Any]) -> None:
        assert self._sync is not None
        if self._sync.chief is not None:
            self._sync.chief.load_state_dict(state["server"])
        for k, shard_state in state.get("shards", {}).items():
            self._shards[int(k)].load_state_dict(shard_state)

    # ------------------------------------------------------------------ serving
    @property
    def addresses(self) -> dict[int, str]:
        """``{shard: address}`` of the servers here (EASGD: ``{0: the centre's}``)."""
        if self._sync is not None:
            return self._sync.addresses()
        return {0: self._hosted.address} if self._hosted is not None else {}

    def join(self) -> None:
        """Serve until every worker left (or was silent for ``timeout`` seconds), then stop."""
        if self._sync is not None:
            self._sync.close(math.inf)
        elif self._hosted is not None:
            self._hosted.close(math.inf)
            self._hosted = None
        log.info("dedicated server rank %d: every worker left", self.rank)

    def state_dict(self) -> dict[str, Any]:
        """This server's checkpoint: SyncReplicas' chief state (``"server"``) and the shards it
        hosts (``"shards"``), or the EASGD centre (``"centre"``)."""
        if self._centre is not None:
            return {"kind": CENTRE, "centre": [c.clone() for c in self._centre.centre]}
        assert self._sync is not None
        # a restarted rank holds the chief as its standby (promoted, or bit-identical)
        chief = self._sync.chief or self._sync.standby_chief
        return {
            "kind": SYNC,
            "server": chief.state_dict() if chief is not None else None,
            "shards": {k: shard.state_dict() for k, shard in self._shards.items()},
        }


def _factory_optimizer(
    factory: OptimizerFactory | None, groups: list[dict[str, Any]], values: list[torch.Tensor]
) -> torch.optim.Optimizer:
    """The wrapped optimizer over ``values``, in the workers' parameter groups (the spec's
    ``groups``: each group's parameter count and hyperparameters)."""
    if factory is None or not callable(factory):
        raise ValueError(
            "serve(optimizer=...) must be a factory of the wrapped optimizer for "
            "SyncReplicasOptimizer, e.g. lambda groups: torch.optim.SGD(groups), got "
            f"{factory!r}"
        )
    param_groups, start = [], 0
    for g in groups:
        param_groups.append({"params": values[start : start + g["count"]], **g["hyper"]})
        start += g["count"]
    opt = factory(param_groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer factory returned {type(opt).__name__}")
    mine = [p for g in opt.param_groups for p in g["params"]]
    if len(mine) != len(values) or any(a is not b for a, b in zip(mine, values, strict=False)):
        raise ValueError("the optimizer factory must keep the groups' parameters in order")
    return opt


def _empty(shape: Sequence[int], dtype: str) -> torch.Tensor:
    return torch.zeros(list(shape), dtype=getattr(torch, dtype))


def _hosted_pieces(spec: dict[str, Any], rank: int) -> list[Any]:
    """The pieces of the variables that SyncReplicas server ``rank`` hosts, shard by shard."""
    placement = spec["placement"]
    pieces = placement.pieces or whole(len(spec["layout"]))
    return [
        pieces[j] for k, r in enumerate(placement.ranks) if r == rank for j in placement.parts[k]
    ]


def _hosted_values(spec: dict[str, Any], rank: int) -> list[torch.Tensor]:
    """Server ``rank``'s variables: zeros of their shapes where it hosts a piece of them,
    zero-size placeholders elsewhere."""
    hosted = {pc.index for pc in _hosted_pieces(spec, rank)}
    return [_empty(s if i in hosted else [0], d) for i, (s, d) in enumerate(spec["layout"])]


def _chief_standby(address: str, rank: int, timeout: float) -> str | None:
    """Where the standby of the SyncReplicas chief at ``address`` is (None without one): a
    read-only question, which neither counts as a worker nor reaches the standby."""
    client = MailboxClient(address, f"server-rank{rank}", timeout + 10.0, "the chief", data=False)
    return client.call("where_standby", worker=-1).get("standby")


def serve(
    optimizer: OptimizerFactory | None = None,
    *,
    host: str | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run this rank as a dedicated server of the job until every worker left; returns its
    final state (:meth:`ParameterServer.state_dict`, a checkpoint for ``state=``).

    ``optimizer``: the wrapped optimizer's factory (SyncReplicas), called with the workers'
    parameter groups.  See the module docstring for what the server learns from the workers.
    """
    server = ParameterServer(optimizer, host=host, state=state)
    server.join()
    return server.state_dict()


def _directory(spec: dict[str, Any], joining: bool) -> ServerDirectory | None:
    """The job's directory of its servers that the spec names (the workers' exchange's), or
    None (no standbys)."""
    name = spec.get("directory")
    return None if name is None else job_directory(name, joining, spec["job"].timeout)
