"""Hosting the servers' state machines: where they listen, how workers learn the address, when
they stop.

* :func:`server_host` -- the interface a wrapper's server listens on when the user gives no
  ``host=``: loopback while every rank of the job is on this host, else this host's address on
  the route to ``MASTER_ADDR`` (the network the process group's rendezvous uses), never the
  wildcard; if the ranks are on several hosts and no such address exists, every rank raises
  the same error naming ``host=`` before anything waits.  :func:`env_server_host` is the part
  that needs no collective (the CLI's launchers use it).
* :class:`HostedServer` -- serves one state machine (``handle``/``tick`` returning
  :class:`~.replies.Answer` objects and effects) on a :class:`~.transport.MailboxServer`,
  sends the answers, hands effects to ``perform``, and :meth:`~HostedServer.close` waits
  until its :class:`~.membership.Membership` says every worker left.
* :func:`share_address` / :func:`gather_addresses` -- tell the group where the servers are.
* :func:`probe` -- a liveness check of another server.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from ..common.membership import Membership
from ..common.replies import Answer, error
from ..transport import MailboxServer, store_client
from ..transport.state_transfer import pack_state, unpack_state
from .standby import ATTACH, DATA, DROPPED, REPLICA, Forwarder, StandbyRole

__all__ = [
    "HostedServer",
    "StateMachine",
    "choose_server_host",
    "env_server_host",
    "gather_addresses",
    "probe",
    "server_host",
    "share_address",
]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOCAL_READS = frozenset({"read"})  # what a standby answers its own rank's worker itself
WILDCARDS = ("0.0.0.0", "::", "")


# ----------------------------------------------------------------------------- where to listen
def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return False


def route_address(target: str | None, port: int = 9) -> str | None:
    """This host's address on the route to ``target`` (loopback for a loopback target; None
    when ``target`` is unset or cannot be resolved).  A UDP ``connect`` sends nothing: it asks
    the kernel which local address routes there."""
    if not target:
        return None
    if _is_loopback(target):
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(target), port))
            return str(s.getsockname()[0])
    except OSError as exc:
        log.warning("no route to %s (%s): the server host cannot be derived from it", target, exc)
        return None


def _forced_host() -> str | None:
    """``GRADFLEET_SERVER_HOST`` if set (checked: one interface, not the wildcard)."""
    given = os.environ.get("GRADFLEET_SERVER_HOST")
    if not given:
        return None
    if given in WILDCARDS:
        raise ValueError(
            "GRADFLEET_SERVER_HOST must be one interface's address, not the wildcard "
            f"{given!r}: the server has no authentication"
        )
    return given


def env_server_host() -> str:
    """From the environment alone: ``GRADFLEET_SERVER_HOST`` if set, loopback for a job whose
    ``MASTER_ADDR`` is loopback (or unset), else this host's address on the route to
    ``MASTER_ADDR``.  Never the wildcard address."""
    forced = _forced_host()
    if forced is not None:
        return forced
    master = os.environ.get("MASTER_ADDR", LOOPBACK)
    address = route_address(master, int(os.environ.get("MASTER_PORT", 9)))
    if address is None:
        raise ValueError(
            f"no route to MASTER_ADDR={master!r}: set GRADFLEET_SERVER_HOST to this host's "
            "address on the cluster network"
        )
    return address


def choose_server_host(places: list[tuple[str, str | None]], rank: int, owner: str) -> str:
    """The host a server on ``rank`` listens on, given every rank's ``(host name, address on
    the route to MASTER_ADDR)``.  The same ``places`` give every rank the same decision, so a
    failure is raised on every rank alike.

    One place for all ranks: loopback.  Several: ``places[rank]``'s address, which must be a
    non-loopback address on every rank, else ``ValueError`` naming ``host=``."""
    if len(set(places)) <= 1:
        return LOOPBACK
    unusable = sorted({r for r, (_, a) in enumerate(places) if a is None or _is_loopback(a)})
    if unusable:
        hosts = sorted({name for name, _ in places})
        raise ValueError(
            f"{owner}: the job's ranks are on several hosts ({', '.join(hosts)}), but rank(s) "
            f"{unusable} have no address towards MASTER_ADDR="
            f"{os.environ.get('MASTER_ADDR')!r} that the other hosts can reach; pass host= "
            "(this host's address on the cluster network) or set GRADFLEET_SERVER_HOST"
        )
    address = places[rank][1]
    assert address is not None
    return address


def server_host(host: str | None, owner: str, group: Any = None) -> str:
    """Where a server of ``owner`` listens: ``host`` if given, else ``GRADFLEET_SERVER_HOST``,
    else :func:`choose_server_host` over every rank of ``group``.

    Collective: every rank of the group calls it (the wrappers' construction already
    synchronises them), and the ranks' places are gathered even where ``host`` is given, so a
    job that passes ``host=`` on some ranks only cannot hang here."""
    mine = (socket.gethostname(), route_address(os.environ.get("MASTER_ADDR")))
    places: list[Any] = [mine]
    rank = 0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        places = [None] * dist.get_world_size(group)
        dist.all_gather_object(places, mine, group=group)
        places = [tuple(p) for p in places]
        rank = dist.get_rank(group)
    if host is not None:
        return host
    forced = _forced_host()
    if forced is not None:
        return forced
    chosen = choose_server_host(places, rank, owner)
    if chosen != LOOPBACK:
        log.info("%s: ranks on several hosts, servers listen on %s", owner, chosen)
    return chosen


# ----------------------------------------------------------------------------- addresses
def share_address(address: str | None, src: int, group: Any = None) -> str:
    """Rank ``src`` (a rank of ``group``) tells every rank of the group its server address."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        assert address is not None
        return address
    box = [address]
    root = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(box, src=root, group=group)
    return box[0]


def gather_addresses(mine: dict[int, str]) -> dict[int, str]:
    """Every rank's ``{server id: address}`` merged (all ranks of the default group call it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(mine)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {int(k): a for part in gathered for k, a in part.items()}


def probe(address: str, seconds: float, connect_s: float | None = None) -> Callable[[], None]:
    """A liveness check of the server at ``address``: the check raises once it is gone (no
    answer within ``seconds``).  Connecting may take ``connect_s`` (default ``seconds``), as
    long as a store client's: a connect to a live server occasionally stalls for seconds on a
    loaded machine, while a dead one refuses at once."""
    host, port = address.rsplit(":", 1)
    wait = seconds if connect_s is None else max(seconds, connect_s)
    store = store_client(host, int(port), wait)
    store.set_timeout(timedelta(seconds=seconds))

    def check() -> None:
        store.queue_len("gf/probe")

    return check


# ----------------------------------------------------------------------------- serving
class StateMachine(Protocol):
    """What :class:`HostedServer` serves: requests in, answers and effects out, no I/O."""

    def handle(self, msg: dict[str, Any], ticket: Any) -> list[Any]: ...

    def tick(self) -> list[Any]: ...


class HostedServer:
    """Serve ``machine`` on a :class:`~.transport.MailboxServer` listening on ``host``.

    Answers go back to their requests; any other output is an effect passed to ``perform``
    (in the handler call, in order).  ``watch`` (optional) runs on every tick before the
    machine's own ``tick`` and may return answers too (e.g. after probing other servers).
    A replicated machine (:mod:`.standby`): the primary's server is given its standby's
    address with :meth:`forward_to`, and every request that may change the state is handled
    there first; the standby's is made with ``standby=True``.  ``announce`` (optional) is
    called with this server each time where it or its standby is changes (a standby attached
    and holds the whole state, its standby found lost, this standby took over), for
    :mod:`.server_directory`.
    """

    def __init__(
        self,
        machine: StateMachine,
        members: Membership,
        host: str,
        name: str,
        perform: Callable[[Any], None] | None = None,
        watch: Callable[[], list[Any]] | None = None,
        standby: bool = False,
        announce: Callable[[HostedServer], None] | None = None,
    ) -> None:
        self.machine, self.members, self.name = machine, members, name
        self._perform, self._watch, self._announce = perform, watch, announce
        self.forwarder: Forwarder | None = None
        # the standby this server forwards to, (address, rank), while it is live; the number
        # of the copy that gives a newly attached one the whole state (announced once done)
        self.named_standby: tuple[str, int] | None = None
        self._attached_at: int | None = None
        self._held: deque[tuple[int, list[Any]]] = deque()  # answers waiting for the standby
        self.standby = StandbyRole(f"standby of the {name}") if standby else None
        self.local_reads = 0  # reads a standby answered its own rank's worker
        self.mailbox = MailboxServer(self._handle, host=host, tick=self._tick)

    def forward_to(self, address: str, rank: int, timeout: float) -> None:
        """From now on, hand every request that may change the state to the standby at
        ``address`` (on ``rank``), and answer it once the standby has it.  The machine says
        which fields its workers send the standby themselves (``standby_direct``) and which
        answers need not wait (``standby_early``), see :class:`~.standby.Forwarder`; a
        machine with ``standby`` / ``standby_rank`` tells its workers where it is."""
        name = f"the {self.name}'s standby on rank {rank}"
        self.forwarder = Forwarder(
            address, name, timeout, wake=self.mailbox.wake,
            direct=getattr(self.machine, "standby_direct", None),
            replaced=getattr(self.machine, "standby_replaced", None),
            early=tuple(getattr(self.machine, "standby_early", ())),
            extra=getattr(self.machine, "copy_fields", None),
        )  # fmt: skip
        if hasattr(self.machine, "standby"):
            self.machine.standby, self.machine.standby_rank = address, rank
        self.named_standby = (address, rank)

    @property
    def address(self) -> str:
        return self.mailbox.address

    @property
    def took_over(self) -> bool:
        """A standby's server that took its primary's place (a worker came to it)."""
        return self.standby is not None and self.standby.promoted

    def _attach(self, msg: dict[str, Any], reply: Any) -> None:
        """A restarted process asks to be this primary's standby (:mod:`.standby`): its first
        copy is the machine's whole state, and the answer waits until it has it."""
        live = self.forwarder is not None and self.forwarder.client is not None
        state = getattr(self.machine, "replica_state", None)
        why = (
            "it is a standby" if self.standby is not None and not self.standby.promoted
            else "it has a live standby" if live
            else "its state machine cannot be replicated" if state is None
            else None
        )  # fmt: skip
        if why is not None:
            _send(error(reply, "RuntimeError", f"{self.name}: no new standby, {why}"))
            return
        assert state is not None
        self.forward_to(msg["address"], int(msg["rank"]), float(msg["seconds"]))
        assert self.forwarder is not None
        # packed: the wire's JSON would turn the state's int keys (an optimizer's) to strings
        skeleton, tensors = pack_state(state())
        replica = {"op": REPLICA, "worker": -1, "skeleton": skeleton, "tensors": tensors}
        number = self.forwarder.forward(replica)
        self._attached_at = number
        log.info("%s: a standby on rank %s attached", self.name, msg["rank"])
        self._held.append((number, [Answer(reply, {})]))
        self._release()

    def _forget_lost_standby(self) -> None:
        """Once the forwarder found its standby lost, the machine stops naming it to the
        workers (they would send it their data, and a restarted process would take it for a
        live standby and not offer to become one)."""
        lost = self.forwarder is not None and self.forwarder.client is None
        if not lost or self.forwarder.deposed is not None:
            return
        if getattr(self.machine, "standby", None):
            self.machine.standby = self.machine.standby_rank = None  # type: ignore[attr-defined]
        if self.named_standby is not None:
            self.named_standby = self._attached_at = None
            self._say_where()

    def _say_where(self) -> None:
        if self._announce is not None:
            self._announce(self)

    def _handle(self, msg: dict[str, Any], reply: Any) -> None:
        self._forget_lost_standby()
        if msg["op"] == ATTACH:
            self._attach(msg, reply)
            return
        if self.standby is not None and not self.standby.promoted and msg["op"] in LOCAL_READS:
            # a worker on this rank reads its values here (they are the primary's as of every
            # answer it has had), not over the primary's link; no takeover
            self.local_reads += 1
            self._emit(self.machine.handle(msg, reply))
            return
        if self.standby is not None:
            promoted = self.standby.promoted
            try:
                copies = self.standby.admit(msg, reply)
            except RuntimeError as exc:  # the primary's copy after the promotion
                _send(error(reply, "RuntimeError", str(exc)))
                return
            if copies is not None:  # the primary's copies: handled here, answered to it
                if msg["op"] == DATA:
                    _send(Answer(reply, {}))
                ready, acks = copies
                for request in ready:
                    if request["op"] == REPLICA:  # the state, unpacked (kept: own copies)
                        tensors = [t.clone() for t in request["tensors"]]
                        state = unpack_state(request["skeleton"], tensors)
                        request = {"op": REPLICA, "worker": -1, **state}
                    self._emit(self.machine.handle(request, DROPPED))
                for ack in acks:
                    _send(Answer(ack, {}))
                return
            take_over = getattr(self.machine, "take_over", None)
            if not promoted and take_over is not None:  # this request promoted it
                take_over()
            if not promoted:
                self._say_where()  # the server now, without a standby
        number = None
        if self.forwarder is not None:
            if self.forwarder.failure is not None:  # a bug in forwarding: raised as itself
                raise self.forwarder.failure
            if self.forwarder.deposed is not None:  # the standby took over: nothing here
                _send(error(reply, "ServerUnreachable", self.forwarder.deposed))
                return
        # handled first: a request the machine refuses (bad input: it changes nothing, its
        # worker gets the error) is not forwarded, so the standby never refuses a copy
        outputs = self.machine.handle(msg, reply)
        if self.forwarder is not None:
            number = self.forwarder.forward(msg)
        if number is None:
            self._emit(outputs)
        else:  # answered once the standby has it
            self._held.append((number, outputs))
            self._release()

    def _release(self) -> None:
        """Send the held answers whose copies the standby has handled, in order; once the
        standby took over, or forwarding failed, answer them with that error instead."""
        assert self.forwarder is not None
        while self._held:
            number, outputs = self._held[0]
            state = self.forwarder.state(number)
            if state == "waiting":
                return
            self._held.popleft()
            if state == "done":
                if self._attached_at is not None and number >= self._attached_at:
                    self._attached_at = None  # the new standby holds the whole state: said
                    self._say_where()  # before its attach is answered
                self._emit(outputs)
                continue
            failure = self.forwarder.failure
            kind, message = (
                ("ServerUnreachable", str(self.forwarder.deposed)) if state == "deposed"
                else (type(failure).__name__, str(failure))
            )  # fmt: skip
            _refuse(outputs, kind, message)

    def _tick(self) -> None:
        self._forget_lost_standby()
        if self._held:
            self._release()
        if self._watch is not None:
            self._emit(self._watch())
        outputs = self.machine.tick()
        # a tick that changed the state (a chosen R lowered) hands the standby requests that
        # make the same change; its answers wait for them as a request's would
        ticked = getattr(self.machine, "tick_requests", None)
        requests = [] if ticked is None else ticked()
        if self.forwarder is None or not requests:
            self._emit(outputs)
            return
        if self.forwarder.deposed is not None:  # the standby took over: nothing from here
            _refuse(outputs, "ServerUnreachable", self.forwarder.deposed)
            return
        numbers = [n for n in map(self.forwarder.forward, requests) if n is not None]
        if not numbers:  # (no standby left)
            self._emit(outputs)
            return
        self._held.append((max(numbers), outputs))
        self._release()

    def _emit(self, outputs: list[Any]) -> None:
        for i, out in enumerate(outputs):
            if isinstance(out, Answer):
                _send(out)
                continue
            try:
                if self._perform is None:
                    raise TypeError(f"{self.name}: no way to perform the effect {out!r}")
                self._perform(out)
            except Exception as exc:
                # the answers after a failed effect (e.g. a shard's report to a dead chief)
                # would otherwise never be sent, and their workers wait for the timeout:
                # they get the effect's error, which names its cause
                for rest in outputs[i + 1 :]:
                    if isinstance(rest, Answer):
                        _send(error(rest.ticket, type(exc).__name__, str(exc)))
                raise

    def close(self, deadline: float) -> None:
        """Serve until every expected worker left or went silent (or ``deadline``, a
        ``time.monotonic()`` value), then stop."""
        while time.monotonic() < deadline and not self.members.finished():
            time.sleep(0.02)
        if not self.members.finished():
            staying = sorted(set(range(self.members.expected)) - self.members.left)
            log.warning("%s: stops with worker rank(s) %s not gone yet", self.name, staying)
        if self.forwarder is not None:
            self.forwarder.close()
        self.mailbox.close()


def _refuse(outputs: list[Any], kind: str, message: str) -> None:
    """Answer every request among ``outputs`` with the error ``kind`` (its effects are not
    performed: the state they came from is not the standby's)."""
    for out in outputs:
        if isinstance(out, Answer):
            _send(error(out.ticket, kind, message))


def _send(answer: Answer) -> None:
    answer.ticket.send(answer.payload, share=answer.share, fresh=answer.fresh)
