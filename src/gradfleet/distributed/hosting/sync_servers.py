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

A replicated job (``job.standby``): each server -- the chief, and every other shard -- has a
standby on another rank, which hosts a second :class:`SyncChief` or
:class:`~..sync.server.shards.ShardServer`, served as a standby (:mod:`.standby`); it asks its
primary to take it (``standby_attach``) and starts from the primary's whole state.
:func:`start_standby` is the collective every rank of the job takes part in for them.  Both
copies then follow the hyperparameters the workers' pushes carry.  A standby shard reports its
updates to the chief only once it took over (the first then says how far it is: its primary's
last report may have been lost with it); with a replicated chief the shards wait for the
chief's answer to each report, and send it to the chief's standby when the chief is lost, so
no update a shard made is lost with the chief.  The chief probes only the server ranks
whose shards have no standby.

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
from collections.abc import Callable, Collection, Sequence
from functools import partial
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
from .server_directory import Place, ServerDirectory
from .standby import ATTACH

__all__ = ["SyncServers", "PROBE_S", "start_standby"]

log = logging.getLogger(__name__)

PROBE_S = 0.5


class SyncServers:
    """The chief and shard servers that ``placement`` gives rank ``rank`` (see module
    docstring), serving ``job``; ``hyperparameters_from_workers``: a dedicated server's copy
    follows the hyperparameters the workers' pushes carry.  ``standbys``: per shard, the rank
    of its standby or None (this rank hosts the copies of the shards whose standby it is);
    ``standby_of``: only the copies of these shards (0: the chief), none of the servers (a
    restarted process that becomes the standby of running servers that have none:
    :meth:`rejoin`); ``directory``: where each server here and its standby are is said there
    (:mod:`.server_directory`), and a shard asks it where the chief went once it is lost."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        job: Job,
        placement: Placement,
        rank: int,
        host: str,
        *,
        hyperparameters_from_workers: bool = False,
        standbys: Sequence[int | None] = (),
        standby_of: Collection[int] = (),
        directory: ServerDirectory | None = None,
    ) -> None:
        ranks, parts, pieces = placement.ranks, placement.parts, placement.pieces
        self.standbys = list(standbys) or [None] * len(ranks)
        replicated = any(r is not None for r in self.standbys) or bool(standby_of)
        # a replicated job's shards wait for the chief's answer to each report: one the
        # chief took with it is sent again where the chief is now
        self.replicated, self.directory = replicated, directory
        follow = hyperparameters_from_workers or replicated
        self.ranks, self.timeout, self.rank = list(ranks), job.timeout, rank
        self.chief: SyncChief | None = None
        self._chief_server: HostedServer | None = None
        self.shards: dict[int, tuple[ShardServer, HostedServer]] = {}
        self._reports: dict[int, MailboxClient] = {}  # shard k -> its link to the chief
        self._resizes: dict[int, MailboxClient] = {}  # the chief's links to shards 1..
        self._unread: set[int] = set()  # shards whose last report's answer is not read yet
        self._unread_resizes: set[int] = set()
        self._shard_addresses: dict[int, str] = {}  # shards 1.., for a chief's copy's resizes
        self._linked = threading.Event()
        self._probes: dict[str, Callable[[], None]] = {}
        # the probing thread's first failure, (whom, error), for the chief's tick to decide
        self._probe_failure: tuple[str, BaseException] | None = None
        self._stop_probing = threading.Event()
        self._prober: threading.Thread | None = None
        self._probe_s = min(self.timeout, 5.0)  # how long one probe may wait for its answer
        self.standby_rank = self.standbys[0]  # the chief's standby's rank
        self.standby_chief: SyncChief | None = None  # the chief's copy, on its standby's rank
        self.standby_server: HostedServer | None = None
        # the copies of shards 1.. whose standby this rank is; what each reported once it
        # took over; where the chief's standby is (set by start_standby)
        self.standby_shards: dict[int, tuple[ShardServer, HostedServer]] = {}
        self._took_over: set[int] = set()
        self.chief_standby: str | None = None
        # per shard: where the chief's standby is, as the chief's last answer to its report
        # said (until one did, ``chief_standby``)
        self._chief_standbys: dict[int, str | None] = {}
        only = set(standby_of)
        if only:  # this rank holds these copies (the others' standbys are not its business)
            self.standbys = [rank if k in only else None for k in range(len(ranks))]
            self.standby_rank = self.standbys[0]
        if rank == self.ranks[0] and not only:
            self.chief = SyncChief(opt, job, parts[0], len(self.ranks), pieces)
            self.chief.shard.follow_workers = follow
            self._chief_server = HostedServer(
                self.chief, self.chief.members, host, "SyncReplicas chief", watch=self._watch,
                perform=self._resize, announce=partial(self._say_where, 0),
            )  # fmt: skip
        if rank == self.standbys[0]:
            self.standby_chief = SyncChief(opt, job, parts[0], len(self.ranks), pieces)
            self.standby_chief.shard.follow_workers = True
            # a chosen R comes with each copy from the primary, never from this rank's clock
            self.standby_chief.choice.follow(self.standby_chief.choice.live_state())
            self.standby_server = HostedServer(
                self.standby_chief, self.standby_chief.members, host,
                f"SyncReplicas chief (standby on rank {rank})", standby=True,
                perform=self._standby_resize, announce=partial(self._say_where, 0),
            )  # fmt: skip
        for k in range(1, len(self.ranks)):
            if rank not in (self.ranks[k], self.standbys[k]) or (only and k not in only):
                continue
            copy = rank == self.standbys[k]
            shard = Shard(opt, parts[k], job, pieces)
            shard.follow_workers = follow
            if job.policy is not None:
                shard.measure()
            server = ShardServer(k, shard, job)
            name = f"SyncReplicas shard {k}" + (f" (standby on rank {rank})" if copy else "")
            hosted = HostedServer(
                server, server.members, host, name, perform=self._report, standby=copy,
                watch=partial(self._took_over_report, k) if copy else None,
                announce=partial(self._say_where, k),
            )  # fmt: skip
            (self.standby_shards if copy else self.shards)[k] = (server, hosted)

    def addresses(self) -> dict[int, str]:
        """``{shard: address}`` of the servers hosted here (the chief is shard 0)."""
        mine = {k: hosted.address for k, (_, hosted) in self.shards.items()}
        if self._chief_server is not None:
            mine[0] = self._chief_server.address
        return mine

    def connect(self, addresses: dict[int, str]) -> None:
        """Every server's address is known: link the shards to the chief, let the chief
        probe the shard servers."""
        for k in [*self.shards, *self.standby_shards]:
            self._reports[k] = self._chief_link(k, addresses[0])
        self._shard_addresses = {k: a for k, a in addresses.items() if k}
        if self.chief is not None and self.chief.policy is not None:
            for k in range(1, len(self.ranks)):
                self._link_resize(k, set())
        self._linked.set()
        if self.chief is None:
            return
        hosted: dict[int, list[int]] = {}  # other server ranks -> their shards
        for k in range(1, len(self.ranks)):
            # a shard with a standby is not probed: its workers move to the standby
            if self.ranks[k] != self.ranks[0] and self.standbys[k] is None:
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

    def _chief_link(self, k: int, address: str) -> MailboxClient:
        """Shard ``k``'s link to the chief at ``address`` ("applied" reports: no tensors).
        Named for this rank too: a shard's server and a copy of it on another rank (a
        restarted process that became its standby) are both linked to the chief, and a client
        that connects under a live one's name takes its replies (it forgets those queued for
        an earlier process of its name), which left the server waiting for a report's answer
        until the timeout."""
        return MailboxClient(
            address, f"shard{k}-rank{self.rank}", self.timeout + 10.0,
            f"server rank {self.ranks[0]} (chief)", data=False,
        )  # fmt: skip

    def attach(self, primary: str, k: int = 0) -> None:
        """This rank hosts shard ``k``'s standby (the chief's: 0): ask its primary at
        ``primary`` to take the copy; it answers once the copy holds its whole state."""
        server = self.standby_server if k == 0 else self.standby_shards[k][1]
        assert server is not None
        rank = self.standbys[k] if k else self.standby_rank
        client = MailboxClient(
            primary, f"standby{rank}-{k}", self.timeout + 10.0,
            f"server rank {self.ranks[k]} ({'chief' if k == 0 else f'shard {k}'})", data=False,
        )  # fmt: skip
        client.call(ATTACH, worker=-1, address=server.address, rank=rank, seconds=self.timeout)

    def rejoin(self, addresses: Sequence[str], chief_standby: str | None = None) -> list[int]:
        """A restarted process's copies (``standby_of``) join their running primaries, shard
        ``k``'s at ``addresses[k]``: each asks its primary to take it, which answers once the
        copy holds its whole state (a live peer's).  A copy of a shard reports to the chief
        at ``addresses[0]`` once it took over (to ``chief_standby`` if the chief is lost by
        then).  Returns the shards whose primary took the copy; a primary that refuses (it
        has a standby again, or is gone) has its copy closed here."""
        for k in self.standby_shards:
            self._reports[k] = self._chief_link(k, addresses[0])
        self.chief_standby = chief_standby
        self._linked.set()
        taken = []
        for k in sorted({*self.standby_shards, *([0] if self.standby_server else [])}):
            try:
                self.attach(addresses[k], k)
                taken.append(k)
            except RuntimeError as exc:  # refused, or the primary is gone (ServerUnreachable)
                log.warning("rank %s: not the standby of shard %d: %s", self.standbys[k], k, exc)
                if k == 0:
                    assert self.standby_server is not None
                    self.standby_server.close(time.monotonic())
                    self.standby_server = self.standby_chief = None
                else:
                    self.standby_shards.pop(k)[1].close(time.monotonic())
        return taken

    def standby_addresses(self) -> dict[int, str]:
        """``{shard: address}`` of the standbys hosted here (the chief's is shard 0)."""
        mine = {k: hosted.address for k, (_, hosted) in self.standby_shards.items()}
        if self.standby_server is not None:
            mine[0] = self.standby_server.address
        return mine

    # ------------------------------------------------------------------ effects
    def _report(self, effect: Any) -> None:
        """A shard's :class:`Applied`: tell the chief (in the shard's handler call, before the
        answer to the push that caused it).  A standby's copy reports nothing until it took
        over.

        The answer is read at the next report, not waited for: a worker's token request
        that reaches the chief first simply waits for its token until the report is in, so
        waiting here would only hold the shard's thread for a round trip every update.  A
        chief that died is reported to the pushing workers then (and by the workers' own
        token requests at once).  In a replicated job the answer is waited for: a report the
        chief took with it is sent again to where the chief is now (its standby, which the
        chief answered only once it had the report; or a standby that took over already):
        where the chief's last answer said, else (none, or gone too) where the job's
        directory says.  Were it left
        unread, a report lost with the chief would leave the new chief one update behind
        that shard for good."""
        if not isinstance(effect, Applied):
            raise TypeError(f"SyncReplicas shard: unknown effect {effect!r}")
        copy = self.standby_shards.get(effect.shard)
        if copy is not None and not copy[1].took_over:
            return
        if not self._linked.wait(self.timeout) or effect.shard not in self._reports:
            raise ServerUnreachable(f"shard {effect.shard}: no link to the chief")
        k = effect.shard
        noise = {} if effect.noise is None else {"noise": list(effect.noise)}
        report = {"worker": -1, "shard": k, "step": effect.step, **noise}
        if effect.withdrawn:  # a standby that took over: where, and whose steps come again
            copy = self.standby_shards[k][1]
            report |= {"withdrawn": [list(p) for p in effect.withdrawn], "at": copy.address}
        if k in self._unread:  # the last report's answer (an unreplicated job's)
            self._unread.discard(k)
            self._follow_chief(k, self._reports[k].response())
        if not self.replicated:
            self._reports[k].request("applied", **report)
            self._unread.add(k)
            return
        lost: set[str] = set()  # where the chief did not answer this report
        while True:
            try:
                answer = self._reports[k].call("applied", **report)
                break
            except ServerUnreachable as exc:
                lost.add(self._reports[k].address)
                self._reports[k] = self._next_chief(k, exc, lost)
        self._follow_chief(k, answer)

    def _next_chief(self, k: int, exc: ServerUnreachable, lost: set[str]) -> MailboxClient:
        """Shard ``k``'s link to the chief failed (``exc``) at every address in ``lost``: a
        link to where the chief is now -- the standby the chief's last answer named, else
        where the directory says -- each place that refuses added to ``lost``; raises ``exc``
        once there is none left (each place is tried once: ``lost`` only grows)."""
        while True:
            named = self._chief_standbys.get(k, self.chief_standby)
            if named is not None and named not in lost:
                address = named
            else:
                found = None if self.directory is None else self.directory.next_after(0, lost)
                if found is None:
                    raise exc
                address = found.address
            log.warning("shard %d: the chief is lost (%s); reporting to %s", k, exc, address)
            try:
                return self._chief_link(k, address)
            except ServerUnreachable as gone:  # a standby lost since its chief named it
                log.warning("shard %d: the chief is not at %s either: %s", k, address, gone)
                lost.add(address)

    def _say_where(self, k: int, hosted: HostedServer) -> None:
        """Server ``k``, served here by ``hosted``, says where it and its standby are now."""
        if self.directory is None:
            return
        standby = None if hosted.named_standby is None else Place(*hosted.named_standby)
        self.directory.publish(k, Place(hosted.address, self.rank), standby)

    def _follow_chief(self, k: int, answer: dict[str, Any]) -> None:
        """The chief's answer to shard ``k``'s report names its standby now (none: it has
        lost it, or it is a standby that took over and has none yet; another: a restarted
        process became it): that shard's next reports go there once the chief is lost.  Kept
        per shard: each shard's server reports on a thread of its own, and its answers come
        in the order of its reports."""
        standby = answer.get("standby")
        if standby != self._chief_standbys.get(k, self.chief_standby):
            log.info("shard %d: the chief's standby is now %s", k, standby)
        self._chief_standbys[k] = standby

    def _took_over_report(self, k: int) -> list[Any]:
        """Shard ``k``'s standby's tick: once it took over, its first report says how far it
        is (its primary's last report may have been lost with it)."""
        server, hosted = self.standby_shards[k]
        if k in self._took_over or not hosted.took_over:
            return []
        self._took_over.add(k)
        return [Applied(k, server.shard.step, withdrawn=server.withdrawn_pushes())]

    def _resize(self, effect: Any) -> None:
        """The chief's :class:`Resized`: tell every other shard (answers read at the next one,
        as :meth:`_report` does: a shard may be reporting to the chief right now)."""
        if not isinstance(effect, Resized):
            raise TypeError(f"SyncReplicas chief: unknown effect {effect!r}")
        if not self._linked.wait(self.timeout):
            raise ServerUnreachable("SyncReplicas chief: no link to the shards")
        self._tell_shards(effect)

    def _standby_resize(self, effect: Any) -> None:
        """The chief's copy's :class:`Resized`.  Until it takes over, its primary told the
        shards (each shard's copy is forwarded that ``replicas`` request too): nothing to do.
        Once it took over it tells them itself: a worker lost with the chief's host leaves
        fewer live workers than the R the shards wait for."""
        if not isinstance(effect, Resized):
            raise TypeError(f"SyncReplicas chief (standby): unknown effect {effect!r}")
        assert self.standby_server is not None
        if self.standby_server.took_over:
            self._tell_shards(effect)

    def _tell_shards(self, effect: Resized) -> None:
        """Send every shard 1.. the lowered R (``replicas``).  A shard found lost is told at
        its next place -- where the job's directory says its standby is -- once; a shard with
        none is logged and left to lower its R itself as its workers leave."""
        for k in range(1, len(self.ranks)):
            lost: set[str] = set()
            while True:
                client = self._resizes.get(k) or self._link_resize(k, lost)
                if client is None:
                    log.warning("SyncReplicas chief: shard %d not told R=%d for step %d: "
                                "none of its servers answers", k, effect.replicas,
                                effect.step)  # fmt: skip
                    break
                try:
                    if k in self._unread_resizes:
                        self._unread_resizes.discard(k)
                        client.response()
                    client.request("replicas", worker=-1, step=effect.step, r=effect.replicas)
                    self._unread_resizes.add(k)
                    break
                except ServerUnreachable as exc:
                    log.warning("SyncReplicas chief: shard %d's server is lost (%s)", k, exc)
                    lost.add(client.address)
                    del self._resizes[k]

    def _link_resize(self, k: int, lost: set[str]) -> MailboxClient | None:
        """A link from the chief to shard ``k`` (for resizes), at the first of its places not
        in ``lost`` -- where it started, then where the job's directory says -- each place
        that refuses added to ``lost``; None where none is left."""
        while True:
            address = self._shard_addresses.get(k)
            if address is None or address in lost:
                found = None if self.directory is None else self.directory.next_after(k, lost)
                if found is None:
                    return None
                address = found.address
            try:
                client = MailboxClient(
                    address, f"chief-rank{self.rank}", self.timeout + 10.0,
                    f"shard {k}'s server at {address}", data=False,
                )  # fmt: skip
            except ServerUnreachable as exc:
                log.warning("SyncReplicas chief: shard %d not at %s: %s", k, address, exc)
                lost.add(address)
                continue
            self._resizes[k], self._shard_addresses[k] = client, address
            return client

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
        for _, hosted in self.standby_shards.values():  # (a promoted one serves until its
            hosted.close(end)  # workers left)
        self.standby_shards = {}
        if self.standby_server is not None:
            self.standby_server.close(end)
            self.standby_server = None
        self._stop_probing.set()
        # a probe still inside its store call when the interpreter finalizes would be ended
        # through torch's C++ frames, aborting the process (..closing): wait for it
        if self._prober is not None:
            self._prober.join(self._probe_s + 1.0)
            self._prober = None


def start_standby(
    servers: SyncServers | None,
    standbys: Sequence[int | None],
    addresses: dict[int, str],
    group: Any = None,
) -> list[str | None]:
    """Each shard's standby joins its primary (collective: every rank of the job, a dedicated
    server's too): the standby's rank tells every rank its address, asks the primary at
    ``addresses[k]`` to take it and starts from its whole state; then no worker says hello
    before the primaries forward.  Each shard's standby address (None without one)."""
    if all(r is None for r in standbys):
        return [None] * len(standbys)
    mine = servers.standby_addresses() if servers is not None else {}
    out: list[str | None] = []
    for k, rank in enumerate(standbys):
        out.append(None if rank is None else share_address(mine.get(k), rank, group))
    if servers is not None:
        servers.chief_standby = out[0]
        for k in mine:
            servers.attach(addresses[k], k)
    dist.barrier(group=group)
    return out
