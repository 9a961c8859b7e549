"""Hosting the SyncReplicas servers of one rank: the chief and the shards ``server_ranks`` give it.

:class:`SyncServers` builds the state machines (:class:`~..sync.server.chief.SyncChief` on
``server_ranks[0]``, a :class:`~..sync.server.shards.ShardServer` for every other shard this
rank hosts), serves each on its own :class:`~.hosted_server.HostedServer`, and performs their
effects: a shard's :class:`~..sync.server.shards.Applied` becomes an ``applied`` report to the
chief, and the chief's rank probes every other server rank every ``PROBE_S`` seconds, so that a
dead one makes every worker fail with an error naming it
(:meth:`~..sync.server.chief.SyncChief.unreachable`).

The probes run on a thread of their own and the chief's tick only reads their verdict: a probe
is a round trip, and over links whose queues are full of gradients it takes tens of
milliseconds, which on the chief's own thread held up tokens, pushes and reports (one probe
per server rank, not per shard: the shards of one rank live and die with its process).

A replicated chief (``job.standby``): the standby's rank hosts a second :class:`SyncChief`,
served as a standby (:mod:`.standby`), which asks the chief to take it (``standby_attach``)
and starts from the chief's whole state; :func:`start_standby` is the collective every rank of
the job takes part in for it.  Both copies then follow the hyperparameters the workers' pushes
carry.

The probing thread hands its first failure to the chief's tick (:meth:`SyncServers._watch`),
which decides once, through the chief (:meth:`~..sync.server.chief.SyncChief.fail`): a probe
that raised one of ``LINK_ERRORS`` found its server lost, and every worker raises
``ServerUnreachable`` naming it; a probe that raised anything else (a bug) makes every worker
raise that error as itself, never "unreachable".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..common.replies import Answer
from ..sync.common.job import Job
from ..sync.layout.assignment import Placement
from ..sync.server.chief import SyncChief
from ..sync.server.shards import Applied, Resized, Shard, ShardServer
from ..transport import LINK_ERRORS, MailboxClient, ServerUnreachable, lost_peer
from .hosted_server import HostedServer, probe, share_address
from .standby import ATTACH

__all__ = ["SyncServers", "PROBE_S", "start_standby"]

log = logging.getLogger(__name__)

PROBE_S = 0.5


class SyncServers:
    """The chief and shard servers that ``placement`` gives rank ``rank`` (see module
    docstring), serving ``job``; ``hyperparameters_from_workers``: a dedicated server's copy
    follows the hyperparameters the workers' pushes carry.  ``standby``: the rank of the
    chief's standby (this rank hosts it if it is ``rank``); ``standby_only``: that copy alone
    (a restarted process that becomes the standby of a running chief)."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        job: Job,
        placement: Placement,
        rank: int,
        host: str,
        *,
        hyperparameters_from_workers: bool = False,
        standby: int | None = None,
        standby_only: bool = False,
    ) -> None:
        ranks, parts, pieces = placement.ranks, placement.parts, placement.pieces
        follow = hyperparameters_from_workers or standby is not None
        self.ranks, self.timeout = list(ranks), job.timeout
        self.chief: SyncChief | None = None
        self._chief_server: HostedServer | None = None
        self.shards: dict[int, tuple[ShardServer, HostedServer]] = {}
        self._reports: dict[int, MailboxClient] = {}  # shard k -> its link to the chief
        self._resizes: dict[int, MailboxClient] = {}  # the chief's links to shards 1..
        self._unread: set[int] = set()  # shards whose last report's answer is not read yet
        self._unread_resizes: set[int] = set()
        self._linked = threading.Event()
        self._probes: dict[str, Callable[[], None]] = {}
        # the probing thread's first failure, (whom, error), for the chief's tick to decide
        self._probe_failure: tuple[str, BaseException] | None = None
        self._stop_probing = threading.Event()
        self._prober: threading.Thread | None = None
        self._probe_s = min(self.timeout, 5.0)  # how long one probe may wait for its answer
        self.standby_rank = standby
        self.standby_chief: SyncChief | None = None  # the copy, on the standby's rank
        self.standby_server: HostedServer | None = None
        if rank == self.ranks[0] and not standby_only:
            self.chief = SyncChief(opt, job, parts[0], len(self.ranks), pieces)
            self.chief.shard.follow_workers = follow
            self._chief_server = HostedServer(
                self.chief, self.chief.members, host, "SyncReplicas chief", watch=self._watch,
                perform=self._resize,
            )  # fmt: skip
        if rank == standby:
            self.standby_chief = SyncChief(opt, job, parts[0], len(self.ranks), pieces)
            self.standby_chief.shard.follow_workers = True
            self.standby_server = HostedServer(
                self.standby_chief, self.standby_chief.members, host,
                f"SyncReplicas chief (standby on rank {rank})", standby=True,
            )  # fmt: skip
        for k in range(1, len(self.ranks)):
            if self.ranks[k] == rank and not standby_only:
                shard = Shard(opt, parts[k], job, pieces)
                shard.follow_workers = hyperparameters_from_workers
                if job.policy is not None:
                    shard.measure()
                server = ShardServer(k, shard, job)
                hosted = HostedServer(
                    server, server.members, host, f"SyncReplicas shard {k}", perform=self._report
                )
                self.shards[k] = (server, hosted)

    def addresses(self) -> dict[int, str]:
        """``{shard: address}`` of the servers hosted here (the chief is shard 0)."""
        mine = {k: hosted.address for k, (_, hosted) in self.shards.items()}
        if self._chief_server is not None:
            mine[0] = self._chief_server.address
        return mine

    def connect(self, addresses: dict[int, str]) -> None:
        """Every server's address is known: link the shards to the chief, let the chief
        probe the shard servers."""
        for k in self.shards:
            self._reports[k] = MailboxClient(
                addresses[0],
                f"shard{k}",
                self.timeout + 10.0,
                f"server rank {self.ranks[0]} (chief)",
                data=False,  # "applied" reports carry no tensors
            )
        if self.chief is not None and self.chief.policy is not None:
            for k in range(1, len(self.ranks)):
                self._resizes[k] = MailboxClient(
                    addresses[k], "chief", self.timeout + 10.0,
                    f"server rank {self.ranks[k]} (shard {k})", data=False,
                )  # fmt: skip
        self._linked.set()
        if self.chief is None:
            return
        hosted: dict[int, list[int]] = {}  # other server ranks -> their shards
        for k in range(1, len(self.ranks)):
            if self.ranks[k] != self.ranks[0]:
                hosted.setdefault(self.ranks[k], []).append(k)
        for r, ks in hosted.items():
            shards = f"shard {ks[0]}" if len(ks) == 1 else f"shards {', '.join(map(str, ks))}"
            name = f"shard server rank {r} ({shards}) at {addresses[ks[0]]}"
            try:
                self._probes[name] = probe(
                    addresses[ks[0]], self._probe_s, connect_s=self.timeout + 10.0
                )
            except LINK_ERRORS as exc:  # died since it shared its address
                raise ServerUnreachable(f"{name} is unreachable: {exc}") from None
        if self._probes:
            self._prober = threading.Thread(target=self._probe, name="gradfleet-probe", daemon=True)
            self._prober.start()

    def attach(self, chief_address: str) -> None:
        """The standby's rank: ask the chief at ``chief_address`` to take this copy as its
        standby; it answers once the copy holds its whole state."""
        assert self.standby_server is not None
        client = MailboxClient(
            chief_address, f"standby{self.standby_rank}", self.timeout + 10.0,
            f"server rank {self.ranks[0]} (chief)", data=False,
        )  # fmt: skip
        client.call(
            ATTACH, worker=-1, address=self.standby_server.address, rank=self.standby_rank,
            seconds=self.timeout,
        )  # fmt: skip

    # ------------------------------------------------------------------ effects
    def _report(self, effect: Any) -> None:
        """A shard's :class:`Applied`: tell the chief (in the shard's handler call, before the
        answer to the push that caused it).

        The answer is read at the next report, not waited for: a worker's token request
        that reaches the chief first simply waits for its token until the report is in, so
        waiting here would only hold the shard's thread for a round trip every update.  A
        chief that died is reported to the pushing workers then (and by the workers' own
        token requests at once)."""
        if not isinstance(effect, Applied):
            raise TypeError(f"SyncReplicas shard: unknown effect {effect!r}")
        if not self._linked.wait(self.timeout) or effect.shard not in self._reports:
            raise ServerUnreachable(f"shard {effect.shard}: no link to the chief")
        client = self._reports[effect.shard]
        if effect.shard in self._unread:
            self._unread.discard(effect.shard)
            client.response()
        noise = {} if effect.noise is None else {"noise": list(effect.noise)}
        client.request("applied", worker=-1, shard=effect.shard, step=effect.step, **noise)
        self._unread.add(effect.shard)

    def _resize(self, effect: Any) -> None:
        """The chief's :class:`Resized`: tell every other shard (answers read at the next one,
        as :meth:`_report` does: a shard may be reporting to the chief right now)."""
        if not isinstance(effect, Resized):
            raise TypeError(f"SyncReplicas chief: unknown effect {effect!r}")
        if not self._linked.wait(self.timeout):
            raise ServerUnreachable("SyncReplicas chief: no link to the shards")
        for k, client in self._resizes.items():
            if k in self._unread_resizes:
                client.response()
            client.request("replicas", worker=-1, step=effect.step, r=effect.replicas)
            self._unread_resizes.add(k)

    def _probe(self) -> None:
        """The probing thread: every ``PROBE_S`` seconds, each other server rank once, until
        a probe fails (its error is for :meth:`_watch` to decide and log) or the servers
        close."""
        while not self._stop_probing.wait(PROBE_S):
            for name, check in self._probes.items():
                try:
                    check()
                except Exception as exc:  # a lost server, or a bug: decided by _watch
                    self._probe_failure = (name, exc)
                    return

    def _watch(self) -> list[Answer]:
        """The chief's tick: a failed probe fails every worker's request (decided once, by
        the chief): ``ServerUnreachable`` for a lost server, the error itself for a bug."""
        chief, failure = self.chief, self._probe_failure
        if chief is None or failure is None:
            return []
        self._probe_failure = None
        name, exc = failure
        if lost_peer(exc):
            first = str(exc).splitlines()[0] if str(exc) else ""
            return chief.unreachable(
                f"SyncReplicasOptimizer: {name} is unreachable (dead or stuck), the chief "
                f"stops at global step {chief.global_step}: {type(exc).__name__}: {first}"
            )
        return chief.fail(
            type(exc).__name__,
            f"SyncReplicasOptimizer: the chief's probe of {name} raised {type(exc).__name__} "
            f"(a bug, not a lost server), the chief stops at global step {chief.global_step}: "
            f"{exc}",
            cause=exc,
        )

    # ------------------------------------------------------------------ end
    def close(self, deadline: float | None = None) -> None:
        """Serve until every worker left or went silent (at most ``timeout`` seconds, or until
        ``deadline``, a ``time.monotonic()`` value), then stop: the shards first, then the
        chief."""
        end = time.monotonic() + self.timeout if deadline is None else deadline
        for _, hosted in self.shards.values():
            hosted.close(end)
        self.shards = {}
        if self._chief_server is not None:
            self._chief_server.close(end)
            self._chief_server = None
        if self.standby_server is not None:  # (a promoted one serves until its workers left)
            self.standby_server.close(end)
            self.standby_server = None
        self._stop_probing.set()
        # a probe still inside its store call when the interpreter finalizes would be ended
        # through torch's C++ frames, aborting the process (..closing): wait for it
        if self._prober is not None:
            self._prober.join(self._probe_s + 1.0)
            self._prober = None


def start_standby(
    servers: SyncServers | None, standby: int | None, chief_address: str, group: Any = None
) -> str | None:
    """The chief's standby joins it (collective: every rank of the job, a dedicated server's
    too): its rank tells every rank its address, asks the chief to take it and starts from
    its whole state; then no worker says hello before the chief forwards.  The standby's
    address (None without one)."""
    if standby is None:
        return None
    mine = servers.standby_server if servers is not None else None
    address = share_address(mine.address if mine is not None else None, standby, group)
    if mine is not None:
        assert servers is not None
        servers.attach(chief_address)
    dist.barrier(group=group)
    return address
