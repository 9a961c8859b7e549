"""A live standby of a server's state machine on another host: chain replication of requests.

A server whose host may be lost (the asynchronous EASGD centre) keeps a *standby*: the same
state machine, started from the same state, on another rank, ideally on another host.  The
*primary* handles each request as it comes, queues a copy of it for the standby, and holds
its answer until the standby has handled the copy (the Parameter Server's chain replication,
Li et al. 2014, with a chain of two); a thread of its own sends the copies, in order, one at a
time, so the primary's handling never waits for the standby.  The machines are deterministic
given their requests in order, so the standby is bit-identical to its primary after every
request the primary answered, and holds every request a worker saw answered.  A request whose
loss is harmless (a read, redone if the primary dies) may be answered at once (``early``).  A
request the primary's machine refuses (it raises: bad input, which changes nothing, such as a
non-finite gradient under ``nonfinite="raise"``) is not forwarded: its worker gets the error.

The large tensors of a request need not travel twice over the primary's link, the busiest of
the job: a request's *direct* fields (the EASGD centre's: a worker's parameters) are sent by
the worker itself to the standby as well, as a ``standby_data`` request, on its own link; the
primary's copy then carries only the control part, and the standby applies it with the
worker's data.  The worker sends the request to the primary only once the standby has
acknowledged the data, so a copy never waits for data that a lost worker took with it, and a
restarted worker's data (its numbers start again) replaces any of its earlier self's (a copy
whose data has not come would wait for it, and the copies after it too).  The copies queued
while one message is on its way go in the next message, together: one round trip for them.
Requests that carry these fields name their ``worker`` and its ``number`` for the request,
which pair copy and data, and ``standby``, the address the worker sent them to: a copy
leaves them out only where that is the standby's (a worker that has not met a new standby
yet sent them to the primary alone, and the copy carries them).  A machine that can say what
it made of a request's large fields needs neither: its copies leave them out (*replaced*
fields) and carry that instead (the SyncReplicas chief: the verdict on a step's gradients,
and the averages of the update it made; :mod:`..sync.server.chief`).  A machine with a
``take_over`` method is told when its standby takes over.  A worker on the standby's own rank
reads its values from the standby (``read``, answered without a takeover), not over the
primary's link: the standby has every request a worker saw answered.

A primary that has no standby (its own was lost, or it is a promoted standby) takes a new
one: a restarted process serves an empty copy and asks, with a ``standby_attach`` request,
to be its standby.  The primary's first copy to it is its whole state (``load_replica``, the
machine's ``replica_state()``), in the order of the requests, and the answer to the attach
waits until the new standby has it; the reads then tell each worker where the standby is, and
a second loss is survived as the first (torchft's live recovery: the state comes from a live
peer, not from a checkpoint).

When the primary's host is lost, its workers move to the standby and send the request they
were waiting on again, under the same number (each machine answers a request it already
handled without applying it twice: the request is redone or applied once, never twice).  The
first request that comes to the standby from a worker, not from the primary, *promotes* it:
from then on it refuses the primary's copies, so a primary that was only cut off for a while
(stopped, a link down) cannot make the two diverge.  Its next forward is refused, and it
answers that request, and every later one, with :class:`ServerUnreachable` naming the
standby, so its workers move too.  A standby that is lost leaves the primary serving alone
(logged).

* :func:`choose_standby` -- which rank hosts the standby: the first rank after the primary's on
  another host, else the next rank (pure); :func:`choose_standbys` the same for several
  servers (a sharded job's), spread over the ranks.
* :class:`Forwarder` -- the primary's side: its client of the standby.
* :class:`StandbyRole` -- the standby's side: copies applied with their answers dropped, and
  the promotion.

:class:`~.hosted_server.HostedServer` owns either (``forward_to=`` / ``standby=``).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..common.replies import DROPPED
from ..transport import MailboxClient, ServerUnreachable

__all__ = [
    "ATTACH",
    "DROPPED",
    "COPY",
    "DATA",
    "REPLICA",
    "READ_ONLY",
    "Forwarder",
    "StandbyRole",
    "choose_standby",
    "choose_standbys",
    "gather_hosts",
    "standby_rank",
    "standby_ranks",
]

log = logging.getLogger(__name__)

COPY = "standby_copy"  # the op of a forwarded request; its own op travels as "copy_of"
DATA = "standby_data"  # a worker's direct fields of a request, sent to the standby itself
ATTACH = "standby_attach"  # a restarted process asks a primary without a standby to be its one
REPLICA = "load_replica"  # the first copy a new standby gets: the primary's whole state
READ_ONLY = frozenset({"read", "members", "where_standby"})  # change nothing: not forwarded
_MAILBOX_FIELDS = ("op", "client", "seq", "inc")  # the mailbox's own, not the request's


def choose_standby(hosts: Sequence[str], primary: int, candidates: Sequence[int]) -> int | None:
    """The rank for the standby of the server on rank ``primary``, given each rank's host name
    (``hosts[r]``): the first of ``candidates`` after ``primary`` (in rank order, wrapping)
    on another host, else the first after it on the same host; None without a candidate."""
    ordered = sorted(r for r in candidates if r != primary)
    if not ordered:
        return None
    after = [r for r in ordered if r > primary] + [r for r in ordered if r < primary]
    elsewhere = [r for r in after if hosts[r] != hosts[primary]]
    return (elsewhere or after)[0]


def choose_standbys(
    hosts: Sequence[str], primaries: Sequence[int], candidates: Sequence[int]
) -> list[int | None]:
    """The ranks of the standbys of servers on ranks ``primaries`` (one per shard, in shard
    order), given each rank's host name: for each, among ``candidates`` other than its primary,
    one on another host than the primary's if there is one, then the rank that hosts the
    fewest servers and standbys so far, then the first after the primary (in rank order,
    wrapping).  One server: :func:`choose_standby`'s choice.  None where no candidate is left."""
    load = Counter(primaries)
    out: list[int | None] = []
    for primary in primaries:
        ordered = sorted(r for r in candidates if r != primary)
        after = [r for r in ordered if r > primary] + [r for r in ordered if r < primary]
        if not after:
            out.append(None)
            continue
        best = min(after, key=lambda r: (hosts[r] == hosts[primary], load[r], after.index(r)))
        load[best] += 1
        out.append(best)
    return out


def gather_hosts(group: Any = None) -> list[str]:
    """Every rank's host name, in the group's rank order (every rank of ``group`` calls it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [socket.gethostname()]
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return [str(h) for h in hosts]


def standby_rank(
    standby: int | bool | None, primary: int, candidates: Sequence[int], group: Any = None
) -> int | None:
    """The rank of the standby of the server on rank ``primary``: ``standby`` itself (a rank),
    or with ``True`` :func:`choose_standby` among ``candidates``; None for ``None``/``False``
    or without a candidate.  Collective where one is asked for: every rank of ``group`` (a
    dedicated server's rank too) gathers the host names."""
    if standby is None or standby is False or not [r for r in candidates if r != primary]:
        return None
    hosts = gather_hosts(group)
    if standby is True:
        return choose_standby(hosts, primary, candidates)
    return int(standby)


def standby_ranks(
    standby: int | bool | None, primaries: Sequence[int], candidates: Sequence[int]
) -> list[int | None]:
    """The rank of each shard's standby (the servers on ranks ``primaries``, in shard order):
    ``standby`` itself for one server (a rank), or with ``True`` :func:`choose_standbys`
    among ``candidates``; Nones for ``None``/``False``.  Collective where one is asked for:
    every rank of the job (a dedicated server's too) gathers the host names."""
    if standby is None or standby is False:
        return [None] * len(primaries)
    if standby is not True:
        return [int(standby)]
    return choose_standbys(gather_hosts(), primaries, candidates)


class Forwarder:
    """The primary's side (module docstring): queues a copy of each request that may change the
    state, and a thread of its own hands them to the standby at ``address``, in order, one at a
    time, so that the primary's handling never waits for the standby.  The caller holds the
    answers of a request until :meth:`state` says its copy was handled there.

    ``direct``: per op, the fields the workers send to the standby themselves (left out of the
    copy); ``early``: ops whose answers need not wait (a request that, lost with the primary,
    is simply redone); ``wake``: called from the thread when a copy was handled; ``extra``:
    the fields each copy carries besides its request's, asked for as it is queued (what the
    primary decided in handling it from what the standby cannot see, such as its clock);
    ``replaced``: per op, the fields no copy carries, because ``extra`` carries what the
    primary made of them (the SyncReplicas chief: a step's verdict and averages, not its
    gradients).
    """

    def __init__(
        self,
        address: str,
        name: str,
        timeout: float,
        direct: dict[str, tuple[str, ...]] | None = None,
        early: tuple[str, ...] = (),
        wake: Callable[[], None] = lambda: None,
        extra: Callable[[], dict[str, Any]] | None = None,
        replaced: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.name, self.direct, self.early, self._wake = name, dict(direct or {}), early, wake
        self.replaced = dict(replaced or {})
        self._extra = extra
        self.address = address
        self.client: MailboxClient | None = MailboxClient(address, "primary", timeout, name)
        self.deposed: str | None = None  # set once the standby took over: every answer fails
        self.failure: BaseException | None = None  # a bug in forwarding: raised as itself
        self._queued = 0  # copies queued, numbered from 1
        self._done = 0  # copies the standby handled (or that need it no more: it is lost)
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="gradfleet-standby", daemon=True)
        self._thread.start()

    def forward(self, msg: dict[str, Any]) -> int | None:
        """Queue a copy of ``msg``; its number, whose answers wait for :meth:`state`, or None
        (nothing to wait for).  Raises :class:`ServerUnreachable` once the standby took over:
        the primary must not handle the request."""
        if self.deposed is not None:
            raise ServerUnreachable(self.deposed)
        if self.client is None or msg["op"] in READ_ONLY:
            return None
        # a request's direct fields went to the standby only where its worker says they did
        # (``standby``: the address it sent them to; a worker that has not met this standby
        # yet, or lost its link to it, sent them to the primary alone: the copy carries them)
        direct = self.direct.get(msg["op"], ()) if msg.get("standby") == self.address else ()
        left_out = (*direct, *self.replaced.get(msg["op"], ()))
        fields = {
            k: _copied(v)  # the request's tensors live until its client's next message only
            for k, v in msg.items()
            if k not in _MAILBOX_FIELDS and k not in left_out
        }
        if direct:
            fields["direct"] = list(direct)
        if self._extra is not None:
            fields.update(self._extra())
        self._queued += 1
        self._copies.put((self._queued, msg["op"], fields))
        return None if msg["op"] in self.early else self._queued

    def state(self, number: int) -> str:
        """``"done"`` (the standby has copy ``number``, or is lost), ``"waiting"``,
        ``"deposed"`` (the standby took over) or ``"failed"`` (:attr:`failure`)."""
        if self.failure is not None:
            return "failed"
        if self._done >= number:
            return "done"
        return "deposed" if self.deposed is not None else "waiting"

    def _run(self) -> None:
        closing = False
        while not closing and (item := self._copies.get()) is not None:
            # every copy queued meanwhile goes in the same message: one round trip for them
            batch = [item]
            while True:
                try:
                    more = self._copies.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.append(more)
            number = batch[-1][0]
            try:
                if self.client is not None and self.deposed is None:
                    copies = [{**fields, "copy_of": op} for _, op, fields in batch]
                    self.client.call(COPY, copies=copies)
            except ServerUnreachable as exc:
                # the client's verdict: the standby is gone (an error reply raises as itself)
                log.warning("%s is lost; this server goes on without a standby: %s",
                            self.name, exc)  # fmt: skip
                self.client = None
            except RuntimeError as exc:
                if not str(exc).startswith("StandbyPromoted"):  # a bug: raised as itself
                    log.error("%s: forwarding failed", self.name, exc_info=exc)
                    self.failure = exc
                    self._wake()
                    return
                self.deposed = f"{self.name} took over (this server was cut off from a worker)"
                log.warning("%s; this server answers no more requests", self.deposed)
                self.client = None
                self._wake()
                continue
            except BaseException as exc:  # a bug: raised as itself by the server
                log.error("%s: forwarding failed", self.name, exc_info=exc)
                self.failure = exc
                self._wake()
                return
            if self.deposed is None:
                self._done = number
            self._wake()

    def close(self) -> None:
        self._copies.put(None)
        self._thread.join(5)
        self.client = None


class StandbyRole:
    """The standby's side (module docstring): :meth:`admit` sorts each request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.promoted = False
        self.data: dict[tuple[int, Any], dict[str, Any]] = {}  # (worker, number) -> fields
        self.pending: deque[dict[str, Any]] = deque()  # the primary's copies, in order
        self.ack: Any = None  # the reply to the primary's message of those copies
        self.paired = 0  # copies applied with the data their workers sent here

    def admit(self, msg: dict[str, Any], reply: Any) -> tuple[list[dict[str, Any]], list] | None:
        """What to do for ``msg`` (answered with ``reply``): None for a worker's own request
        (after which copies are refused); else the primary's copies now complete, in order,
        to be handled with their answers dropped (:data:`DROPPED`), and the replies that
        acknowledge them to the primary.  A worker's data is acknowledged by the caller.
        Raises ``StandbyPromoted`` (a ``RuntimeError`` the primary tells apart) for a copy
        that comes after the promotion."""
        if msg["op"] == DATA:
            if self.promoted:  # sent before the worker heard: it sends the request itself
                return [], []
            key = (int(msg["worker"]), msg.get("number"))
            # kept beyond this request: the link's buffer is reused by the worker's next one
            self.data[key] = {k: _copied(v) for k, v in msg.items() if k in msg["fields"]}
            return self._complete()
        if msg["op"] != COPY:
            if not self.promoted:
                self.promoted = True
                self.data.clear()
                log.warning(
                    "%s takes over: worker client %r came to it (its primary is lost or cut off)",
                    self.name, msg.get("client"),
                )  # fmt: skip
            return None
        if self.promoted:
            raise RuntimeError(f"StandbyPromoted: {self.name} has taken over")
        for copy in msg["copies"]:  # the primary sends one message at a time
            original = {k: v for k, v in copy.items() if k != "copy_of"}
            original["op"] = copy["copy_of"]
            self.pending.append(original)
        self.ack = reply
        return self._complete()

    def _complete(self) -> tuple[list[dict[str, Any]], list]:
        """The pending copies whose workers' data are in, in order, and the primary's ack
        once none is left."""
        ready = []
        while self.pending:
            original = self.pending[0]
            if original.get("direct"):
                key = (int(original["worker"]), original.get("number"))
                data = self.data.pop(key, None)
                if data is None:
                    break  # the next copies wait for this one
                original = {k: v for k, v in original.items() if k != "direct"} | data
                self.paired += 1
            self.pending.popleft()
            ready.append(original)
        acks = []
        if not self.pending and self.ack is not None:
            acks, self.ack = [self.ack], None
        return ready, acks


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return [_copied(v) for v in value]
    return value
