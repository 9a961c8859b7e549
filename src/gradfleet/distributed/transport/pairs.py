"""The data plane: two 2-rank gloo process groups per (server, client incarnation).

A :class:`PairLink` is a pair of ``torch.distributed.ProcessGroupGloo`` of size 2, one per
direction, built directly over ``PrefixStore(f"gf/pair/{client}/{incarnation}/...", store)`` of
the server's control store: rank 0 is the server, rank 1 the client.  Both sides construct
them at the same time (the client asks the server with a ``_pair`` control message, then both
block in the constructors until gloo has connected, at most ``timeout`` seconds).  The
groups of all a process's pairs run on two gloo devices, taken in turn
(``DEVICES_PER_PROCESS``).  Tensors travel with gloo ``send``/``recv`` on raw buffers: no
pickling, received into preallocated memory.  After a small message the receiver posts the
receive of the next one of the same sizes at once (standing receives, below), so that its data
need not wait for its control part.

Why pairs and not one group of every rank: a process group of fixed membership cannot admit a
restarted process, and a dead member breaks every collective.  A pair involves one client:
a restarted worker (a new incarnation) builds a new pair on its ``hello`` while the rest of the
job keeps running, and a dead client breaks only its own pair.  ``dist.new_group`` cannot be
used (it needs the default group and every member), so the group is constructed directly.

A client in the server's own process (the worker on the server rank) gets a :class:`LocalLink`
instead: the sender's byte messages are handed over as they are (no socket, no copy), which
is what a collective does with a rank's own contribution.

Where gloo listens: the server side on the server's ``host``; a client on the local address
that routes to the server (loopback for a loopback server), or ``$GRADFLEET_DATA_HOST``.

Every gloo call of a :class:`PairLink` runs under :func:`~.errors.gloo_link`: a lost peer
raises :class:`~.errors.LinkLost` naming it (gloo's own error is a plain ``RuntimeError``).

A receive whose peer dies while its message is in flight is not woken by gloo: its connection
is closed, yet the wait goes on until the group's timeout (measured with torch 2.13 between
two network namespaces: a 50 MB message cut by a SIGKILL of its sender waited the whole 30 s,
while the same receive with no data in flight raised "Connection closed by peer" within
0.7 s).  So a receive can be given ``alive``, a check that raises one of ``LINK_ERRORS`` once
the peer is gone (a client's: a round trip to its server's control store); the wait then
happens on a thread of the link's own (:class:`_Watcher`) while the caller checks the peer
every ``WATCH_S`` seconds.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import LINK_ERRORS, gloo_link
from .wire import Packer, views

__all__ = ["PairLink", "LocalLink", "local_address_towards"]

log = logging.getLogger(__name__)

SERVER, CLIENT = 0, 1


def local_address_towards(host: str) -> str:
    """The local interface address the kernel would use to reach ``host`` (no packet is
    sent: a UDP socket's ``connect`` only selects the route); ``$GRADFLEET_DATA_HOST`` wins."""
    forced = os.environ.get("GRADFLEET_DATA_HOST")
    if forced:
        return forced
    if host in ("localhost", "") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


# Gloo devices (each a listening socket and an event-loop thread doing its pairs' socket I/O)
# a process's pair links use, taken in turn.  Why 2: a device per link gave a rank that serves
# three workers and pushes to three shards six loop threads, each woken for its own few
# messages (one server at 1e5 parameters: 79-96 updates/s, against 107-137 with 2 devices);
# one device for all serialises a server's receiving on one thread (at 1e8 parameters:
# 0.38-0.46 updates/s, against 0.46-0.48 with 2 and 0.46-0.51 with a device per link).
# Loopback, 2 cores: docs/data-plane.md.
DEVICES_PER_PROCESS = 2
_DEVICES: dict[tuple[int, str, int], Any] = {}
_DEVICES_MADE: dict[int, int] = {}  # process id -> pair links given a device so far
_DEVICES_LOCK = threading.Lock()


def _device(bind: str) -> Any:
    """The gloo device for this process's next pair link on local address ``bind``: one of
    ``DEVICES_PER_PROCESS``, in turn.  Keyed by process id as well: a forked child must not
    use its parent's loop threads."""
    pid = os.getpid()
    with _DEVICES_LOCK:
        turn = _DEVICES_MADE.get(pid, 0)
        _DEVICES_MADE[pid] = turn + 1
        key = (pid, bind, turn % DEVICES_PER_PROCESS)
        if key not in _DEVICES:
            _DEVICES[key] = dist.ProcessGroupGloo.create_device(hostname=bind)
        return _DEVICES[key]


# Standing receives: gloo sends a message only once the receiver has posted its receive, and
# the receiver posts it when the message's control part arrives; for a small message that
# wait (the control's trip, the "ready" notice back, each side's loop thread woken in turn)
# costs more than the bytes.  So after a small message the receiver posts the receive of the
# next message of the same sizes at once, into buffers of its own, on tags of their own.
# Both ends follow the same rule (the sender knows what the receiver has posted), so no message
# says which receive it meets.  Two sets of buffers, used in turn: a message lands only when
# its sender sends it, after the reply to the one before, as with the peer's two inboxes.
STANDING_BYTES = 1 << 20
_STANDING_TAGS = 1 << 16  # turn t's message k: tag _STANDING_TAGS * (1 + t) + k


def _standable(sizes: tuple[int, ...]) -> bool:
    return bool(sizes) and sum(sizes) <= STANDING_BYTES


def _standing_tag(turn: int) -> int:
    """The first tag of a standing message of this turn (0 or 1)."""
    return _STANDING_TAGS * (1 + turn)


class _Standing:
    """A receive posted ahead: the message sizes it takes, its buffers and gloo works."""

    def __init__(self, sizes: tuple[int, ...], buffers: list[torch.Tensor], works: list) -> None:
        self.sizes, self.buffers, self.works = sizes, buffers, works


WATCH_S = 0.5
"""How often a receive that is given ``alive`` checks its peer while it waits."""


class _Watcher:
    """Waits for gloo works on a thread of its own, one batch at a time, so that the caller can
    check meanwhile that the peer lives (module docstring).  A wait given up on (the peer is
    gone) stays on the thread until gloo's timeout ends it; the link is dead by then."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait(self, works: Sequence[Any], alive: Callable[[], None]) -> None:
        """Until every one of ``works`` completed (raising what its wait raised), calling
        ``alive()`` every :data:`WATCH_S` seconds meanwhile (it raises when the peer is gone)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        batch = _Batch(works)
        self._jobs.put(batch)
        while not batch.done.wait(WATCH_S):
            alive()
        if batch.error is not None:
            raise batch.error

    def stop(self) -> None:
        """End the thread once it is idle (a wait given up on keeps it until gloo's timeout)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _run(self) -> None:
        # ended by stop(): a thread left idle at the interpreter's exit is harmless, but one
        # that outlives its link is counted among the threads named at exit (hosting.closing)
        while (batch := self._jobs.get()) is not None:
            try:
                for work in batch.works:
                    work.wait()
            except BaseException as exc:  # handed to the caller, raised there as itself
                batch.error = exc
            finally:
                batch.done.set()


class _Batch:
    """Works one :meth:`_Watcher.wait` waits for: done once all completed, or one raised."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None


class PairLink:
    """Both ends of one server-client data channel (``rank`` 0: server, 1: client);
    ``peer_name`` names the other end in a lost link's :class:`~.errors.LinkLost`."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        bind: str,
        timeout: float,
        peer_name: str | None = None,
    ) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout)
        options._devices = [_device(bind)]
        self.rank, self.peer = rank, 1 - rank
        side = "client" if rank == SERVER else "server"
        self.peer_name = peer_name or f"the {side} of the pair link {prefix}"
        # one group (one socket) per direction, built in the same order on both sides: gloo
        # sends a message only after the receiver's "ready" notice, which travels against the
        # data; on one socket the notice for the client's next message would queue behind
        # the megabytes the server is sending it (EASGD's x waited for the whole c_read)
        with gloo_link(self.peer_name, "connecting"):
            groups = {
                d: dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/{d}", store), rank, 2, options)
                for d in ("to-server", "to-client")
            }
        self._out = groups["to-client" if rank == SERVER else "to-server"]
        self._in = groups["to-server" if rank == SERVER else "to-client"]
        self._sending: list[dist.Work] = []
        self.bytes_sent = self.bytes_received = 0
        # standing receives (above): the sizes the peer has posted one for, and the turn of
        # the next message sent to it; the one this side has posted, and its next turn
        self._peer_standing: tuple[int, ...] | None = None
        self._send_turn = 0
        self._standing: _Standing | None = None
        self._post_turn = 0
        self._standing_buffers: dict[int, list[torch.Tensor]] = {}
        self._watcher = _Watcher(f"gradfleet-receive {self.peer_name}")

    def send(self, messages: list[torch.Tensor]) -> None:
        """Start sending ``messages`` (contiguous host byte buffers, message ``k`` with tag
        ``k``, or with a standing receive's tags when the peer has posted one for these
        sizes); they must stay untouched until :meth:`wait_sent` (called before the next
        send on this link)."""
        self.wait_sent()
        sizes = tuple(m.numel() for m in messages)
        tag = 0
        if sizes and sizes == self._peer_standing:  # the peer's standing receive takes it
            tag = _standing_tag(self._send_turn)
            self._send_turn ^= 1
        with gloo_link(self.peer_name, "send"):
            self._sending = [
                self._out.send([m], self.peer, tag + k) for k, m in enumerate(messages)
            ]
        self.bytes_sent += sum(sizes)
        if self._peer_standing in (None, sizes):  # the peer posts one for the next such
            self._peer_standing = sizes if _standable(sizes) else None

    def wait_sent(self) -> None:
        works, self._sending = self._sending, []
        with gloo_link(self.peer_name, "send"):
            for work in works:
                work.wait()

    def recv(self, messages: list[torch.Tensor]) -> None:
        """Receive the peer's next messages into ``messages`` (sizes must match the send)."""
        with gloo_link(self.peer_name, "receive"):
            landed, works = self._post(messages)
            for work in works:
                work.wait()
        for m, got in zip(messages, landed, strict=True):
            if got is not m:
                m.copy_(got)
        self.bytes_received += sum(m.numel() for m in messages)

    def _post(self, messages: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Post the receives of the peer's next message (``messages``: buffers of its sizes),
        or take the standing receive that matches it: ``(buffers it lands in, works)``."""
        sizes = tuple(m.numel() for m in messages)
        standing, self._standing = self._standing, None
        if standing is not None and standing.sizes == sizes:
            landed, works = standing.buffers, standing.works  # posted before it was sent
        else:
            self._standing = standing  # (None, or for messages of other sizes)
            landed = messages
            works = [self._in.recv([m], self.peer, k) for k, m in enumerate(messages)]
        if self._standing is None and _standable(sizes):
            self._post_standing(sizes)
        return landed, works

    def begin_receive(
        self,
        spec: dict[str, Any],
        inbox: Packer,
        into: Sequence[Any] | None = None,
        alive: Callable[[], None] | None = None,
    ) -> Callable[[], list[torch.Tensor]]:
        """Start receiving the peer's next message of layout ``spec`` into ``inbox`` (or,
        for direct tensors that match them, into the ``into`` tensors: ``Packer.receive``);
        the returned function waits for it and gives its tensors (views of those buffers,
        valid until the next message into ``inbox``; a small message whose receive was
        posted ahead lands in this link's own buffers instead, valid at least as long).
        ``alive``: checked while the wait lasts (module docstring)."""
        buffers = inbox.receive(spec, into)
        with gloo_link(self.peer_name, "receive"):
            messages, works = self._post(buffers)

        def finish() -> list[torch.Tensor]:
            with gloo_link(self.peer_name, "receive"):
                if alive is None:
                    for work in works:
                        work.wait()
                else:
                    self._watcher.wait(works, alive)
            self.bytes_received += sum(m.numel() for m in messages)
            return views(spec, messages)

        return finish

    def receive(
        self,
        spec: dict[str, Any],
        inbox: Packer,
        into: Sequence[Any] | None = None,
        alive: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`begin_receive`, then wait for the message."""
        return self.begin_receive(spec, inbox, into, alive)()

    def _post_standing(self, sizes: tuple[int, ...]) -> None:
        """Post the receive of the peer's next message of these ``sizes`` now, before it is
        sent, so that its data travels as soon as the peer sends it (module docstring)."""
        turn, self._post_turn = self._post_turn, self._post_turn ^ 1
        tag = _standing_tag(turn)
        buffers = self._standing_buffers.get(turn)
        if buffers is None or tuple(b.numel() for b in buffers) != sizes:
            buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            self._standing_buffers[turn] = buffers
        works = [self._in.recv([b], self.peer, tag + k) for k, b in enumerate(buffers)]
        self._standing = _Standing(sizes, buffers, works)

    def close(self) -> None:
        try:
            self.wait_sent()
        except LINK_ERRORS as exc:  # the peer is gone: nothing to finish
            log.debug("pair link closed with unfinished sends: %s", exc)
        self._out = self._in = None  # type: ignore[assignment]
        self.stop_waiting()

    def stop_waiting(self) -> None:
        """End the waiting thread (the link is used no more; its groups stay)."""
        self._watcher.stop()


class LocalLink:
    """One end of a data channel inside one process (``PairLink``'s interface).

    ``send`` hands the byte messages themselves to the other end and ``receive`` returns views
    of them: the sender must leave them untouched until the receiver is done with them, which
    the request/reply protocol guarantees (a client waits for the reply; the server tells the
    client only after its handler returned, see ``mailbox``).  The deques are thread-safe.
    """

    def __init__(self, incoming: deque, outgoing: deque) -> None:
        self._incoming, self._outgoing = incoming, outgoing
        self.bytes_sent = self.bytes_received = 0

    @staticmethod
    def pair() -> tuple[LocalLink, LocalLink]:
        """``(server end, client end)``."""
        to_server: deque = deque()
        to_client: deque = deque()
        return LocalLink(to_server, to_client), LocalLink(to_client, to_server)

    def send(self, messages: list[torch.Tensor]) -> None:
        self._outgoing.append(messages)
        self.bytes_sent += sum(m.numel() for m in messages)

    def wait_sent(self) -> None:
        """Nothing to wait for: the messages were handed over."""

    def begin_receive(
        self,
        spec: dict[str, Any],
        inbox: Packer,
        into: Sequence[Any] | None = None,
        alive: Callable[[], None] | None = None,
    ) -> Callable[[], list[torch.Tensor]]:
        """The message has arrived already: views of the sender's messages (``inbox`` is not
        needed; ``into`` is ignored: copying into it would cost what the caller's own copy
        costs; nothing to wait for, so ``alive`` is not called)."""
        messages = self._incoming.popleft()
        self.bytes_received += sum(m.numel() for m in messages)
        tensors = views(spec, messages)
        return lambda: tensors

    def receive(
        self,
        spec: dict[str, Any],
        inbox: Packer,
        into: Sequence[Any] | None = None,
        alive: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        return self.begin_receive(spec, inbox, into)()

    def close(self) -> None:
        self._incoming.clear()
