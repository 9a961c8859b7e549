"""Request/reply between workers and a server, the server's side (the client's: ``client.py``;
each client as the server sees it, and the replies it owes: ``peer.py``).

Control travels on a c10d ``TCPStore``, tensors on pairs.

The server process hosts a ``torch.distributed.TCPStore`` (bound to ``host``, loopback unless
configured: the listening socket is created here and handed to the store) and serves its request
queue with daemon threads: one takes each request off the queue and starts receiving its
tensors at once, one per client waits for that client's tensors, and one calls
``handler(request, reply)``, one request after another, each once its tensors are in.  So a
request counts as arrived when its data has, and a client on a slow link holds back no one
else: its push is handled after the fast clients' pushes that complete before it (the next
worker's bytes arrive while the handler works on the last, too).  A handler may answer later
(``Reply`` objects are kept until, e.g., a token exists), so blocking waits cost no thread.

A message is split by :mod:`.wire`: its JSON part (op, client, sequence number, incarnation,
small fields, the tensors' layout) travels through the store queues (``gf/req``, and
``gf/rep/{client}`` back), its tensors as one packed buffer on the client's :class:`PairLink`
(gloo send/recv, received into a preallocated buffer).  Tensors a handler or caller receives
are views of that buffer, valid until the next message on the same link: copy what you keep.

What fails where: a lost client (its link raising one of ``LINK_ERRORS``) loses its own pair
and nothing else, logged at WARNING.  Anything else is a bug -- in a handler, in receiving a
request's tensors, in packing a reply -- and is logged at ERROR with its traceback and sent
to the client that waits for the answer, which raises it as itself (``errors.remote_error``):
a bug is never taken for a lost peer.

A client in the server's own process (the worker on the server rank, found by address in
``IN_PROCESS``) gets a :class:`~.pairs.LocalLink`: its tensors are handed over without a
socket or a copy, as a collective treats a rank's own contribution, and its control skips the
store and the server's threads (:meth:`MailboxServer.submit`): an idle server calls the handler
on the client's thread, a busy one queues the request for its handling thread (one handler
call at a time either way), and replies go to a queue of the client's.  So that the server
never reads such a client's tensors after the client resumed, a reply to a local client is
posted only once the handler that sent it has returned.

Why the store for control and not ``torch.distributed.rpc``: a static RPC group cannot admit a
restarted process, a dynamic one makes every joiner call every member, and ``rpc.shutdown``
waits for dead peers.  A store client (and a pair group) can be created at any time, and a dead
server turns into an immediate connection error.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import LINK_ERRORS, error_reply, lost_peer
from .pairs import SERVER, LocalLink, PairLink, local_address_towards
from .peer import LAYOUT, Peer, Reply
from .wire import Packer, dumps, join, loads

__all__ = ["MailboxServer", "REQUESTS", "push_control", "pair_failure"]

log = logging.getLogger(__name__)

REQUESTS = "gf/req"
CLOSED = "gf/closed"  # set when the server stops serving
MAX_CONTROL = 4 << 20  # the store rejects values of ~8 MiB; control messages are tiny
# Servers of this process by address: a client of one of them talks to it in-process.
IN_PROCESS: weakref.WeakValueDictionary[str, MailboxServer] = weakref.WeakValueDictionary()


def pair_failure(prefix: str) -> str:
    """The store key where a server leaves the error that kept it from building a client's
    pair (a bug: a lost client needs no message), for that client to raise as itself."""
    return f"{prefix}/failed"


def push_control(store: dist.Store, name: str, message: dict[str, Any]) -> int:
    """Append ``message`` (JSON) to the store queue ``name``; returns its size in bytes."""
    data = dumps(message)
    if len(data) > MAX_CONTROL:
        raise ValueError(f"gradfleet transport: control message of {len(data)} bytes is too big")
    store.queue_push(name, data)
    return len(data)


Handler = Callable[[dict[str, Any], Reply], None]


class MailboxServer:
    """Host a TCPStore and call ``handler(request, reply)`` for every request, one at a time.

    ``tick`` (if given) runs about every ``tick_s`` seconds, never during a handler call, so
    handler state needs no lock against it.  ``bytes_in`` counts received tensor bytes.
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        tick: Callable[[], None] | None = None,
        tick_s: float = 0.1,
        pair_timeout: float = 60.0,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(512)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.store = dist.TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(days=1),
            master_listen_fd=self._sock.fileno(),
        )
        self._sock.detach()  # the store owns the descriptor now: never close it twice
        # one store connection per thread: the receiving thread blocks in ``queue_pop`` on
        # ``store``, the handling thread answers on its own
        self.reply_store = self.store.clone()
        self._pair_store = self.store.clone()
        self._pair_store.set_timeout(timedelta(seconds=pair_timeout))
        self.pair_timeout = pair_timeout
        self.peers: dict[str, Peer] = {}
        # in-process clients by name: their incarnation and the queue of their replies
        self._local: dict[str, tuple[str, queue.SimpleQueue]] = {}
        # replies to in-process clients sent by the running handler (None: no handler runs)
        self.deferred: list[tuple[str, dict[str, Any]]] | None = None
        self._shared: tuple[Any, dict, list] | None = None
        self._handler, self._tick, self._tick_s = handler, tick, tick_s
        self._stopping = threading.Event()
        self.bytes_in = 0
        self._peers_lock = threading.Lock()  # the receiving thread adds, either thread drops
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # (request, peer, finish) | None
        # one handler call at a time: on the handling thread, or on an in-process client's
        self._handling = threading.Lock()
        self._threads = [
            threading.Thread(target=self._serve, name="gradfleet-server-recv", daemon=True),
            threading.Thread(target=self._handle, name="gradfleet-server", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.pid = os.getpid()  # a forked child inherits the registry but not this thread
        IN_PROCESS[self.address] = self
        if tick is not None:
            self._ticker = threading.Thread(target=self._ticks, name="gradfleet-tick", daemon=True)
            self._ticker.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _ticks(self) -> None:
        poke = self.store.clone()
        while not self._stopping.wait(self._tick_s):
            push_control(poke, REQUESTS, {"op": "_tick"})

    def wake(self) -> None:
        """Run the tick on the handling thread now (another thread has news for it)."""
        self._work.put(({"op": "_tick"}, None, None))

    def connect_local(
        self, client: str, incarnation: str, link: LocalLink | None
    ) -> queue.SimpleQueue:
        """An in-process client (``link``: the server end of its :class:`LocalLink`, None for
        control only): from now on its requests come through :meth:`submit` and its replies
        go to the queue returned, not through the store.  Why: a store message is a TCP round
        trip through the store's thread, and a worker on a server rank sends a quarter of its
        pushes to its own rank (sharded over 4 workers)."""
        if link is not None:
            self.drop(client)
            with self._peers_lock:
                self.peers[client] = Peer(incarnation, link)
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._local[client] = (incarnation, replies)
        return replies

    def submit(self, data: bytes) -> None:
        """A request from an in-process client, on the client's thread (its tensors, on the
        :class:`LocalLink`, are handed over already).  JSON still, as through the store: the
        handler sees the same message (string keys, lists), and a copy of it."""
        if self._stopping.is_set():
            raise ConnectionError(f"the server at {self.address} was closed")
        msg = loads(data)
        started = self._start_receiving(msg)
        if started is None:
            return  # replaced by a newer incarnation: its reply would be ignored
        peer, finish = started
        # handled here and now if the server is idle; else (it may be waiting for a slow
        # client's receive) queued, so that this client is not held up
        if self._work.empty() and self._handling.acquire(blocking=False):
            try:
                self._serve_item(msg, peer, finish)
            finally:
                self._handling.release()
        else:
            self._work.put((msg, peer, finish))

    def post(self, client: str, message: dict[str, Any]) -> None:
        """Send a reply's control part: to an in-process client's queue (once the running
        handler has returned, so that the server never reads the client's tensors after the
        client resumed), else through the store."""
        local = self._local.get(client)
        if local is None or local[0] != message.get("inc"):
            push_control(self.reply_store, f"gf/rep/{client}", message)
        elif self.deferred is not None:
            self.deferred.append((client, message))
        else:
            local[1].put(dumps(message))

    def _pair(self, client: str, incarnation: str, client_host: str) -> None:
        """Build the server end of ``client``'s new pair group (replacing an old one).  Gloo
        listens on ``host``, or (wildcard host) on the address routing to the client."""
        self.drop(client)
        self._local.pop(client, None)  # that name now belongs to a client in another process
        prefix = f"gf/pair/{client}/{incarnation}"
        wildcard = self.host in ("", "0.0.0.0")
        bind = local_address_towards(client_host) if wildcard else self.host
        try:
            link = PairLink(
                self._pair_store, prefix, SERVER, bind, self.pair_timeout, f"client {client}"
            )
        except LINK_ERRORS as exc:  # the client vanished while connecting: no pair, no replies
            log.warning("server %s: no data link with %s: %s", self.address, client, exc)
            return
        except Exception as exc:  # a bug: the client raises it once its own side gives up
            log.error("server %s: building the data link with %s failed", self.address,
                      client, exc_info=exc)  # fmt: skip
            self._pair_store.set(pair_failure(prefix), dumps(error_reply(exc)))
            return
        with self._peers_lock:
            self.peers[client] = Peer(incarnation, link)

    def drop(self, client: str, peer: Peer | None = None) -> None:
        """Forget ``client``'s link and close it; given ``peer``, only if the link is still
        that one (a restarted client may have replaced it meanwhile: then only the stale
        link is closed)."""
        with self._peers_lock:
            current = self.peers.get(client)
            if current is not None and (peer is None or current is peer):
                del self.peers[client]
                peer = current
        if peer is not None:
            if peer.arriving is not None:
                peer.arriving.put(None)  # its waiting thread ends
            peer.link.close()

    def packed(self, tensors: list, share: Any, outbox: Packer) -> tuple[dict, list]:
        """Layout and messages of outgoing ``tensors``: copied into ``outbox``, or (``share``
        given) into one fresh buffer kept for every reply with the same key (in-flight sends
        keep their buffer alive, so a new key never overwrites one)."""
        if share is None:
            return outbox.pack(tensors, direct=True, copy=True)
        if self._shared is None or self._shared[0] != share:
            self._shared = (share, *Packer().pack(tensors, direct=True, copy=True))
        return self._shared[1], self._shared[2]

    def _serve(self) -> None:
        """The receiving thread: take requests off the queue and start receiving their
        tensors; the handling thread takes them from ``_work`` in the same order."""
        while True:
            msg = loads(self.store.queue_pop(REQUESTS))
            op = msg.get("op")
            if op == "_stop":
                self._work.put(None)
                return
            if op == "_pair":
                self._pair(msg["client"], msg["inc"], msg.get("host", "127.0.0.1"))
                continue
            self._accept(msg)

    def _start_receiving(self, msg: dict[str, Any]) -> tuple[Peer | None, Any] | None:
        """Take the layout out of ``msg`` and start receiving its tensors: ``(peer, finish)``,
        ``(None, None)`` for a request without tensors, None if there is no link to receive
        from (that incarnation is gone, or its link just broke)."""
        layout = msg.pop(LAYOUT, None)
        if layout is None:
            return None, None
        with self._peers_lock:
            peer = self.peers.get(msg.get("client", ""))
        if peer is None or peer.incarnation != msg.get("inc"):
            return None
        finish = self._receiving(
            msg, peer, lambda: peer.link.begin_receive(layout, peer.next_inbox())
        )
        return None if finish is None else (peer, finish)

    def _accept(self, msg: dict[str, Any]) -> None:
        """Start receiving a request's tensors; queue it for the handling thread (through its
        client's waiting thread while they travel)."""
        started = self._start_receiving(msg)
        if started is None:
            return
        peer, finish = started
        if peer is None:
            self._work.put((msg, None, None))
            return
        if peer.arriving is None:
            peer.arriving = queue.SimpleQueue()
            threading.Thread(
                target=self._arrive, args=(peer,), name="gradfleet-server-data", daemon=True
            ).start()
        peer.arriving.put((msg, finish))

    def _arrive(self, peer: Peer) -> None:
        """One client's waiting thread: wait for each of its requests' tensors, then queue
        the request for the handling thread (in the order the clients' data completes; one
        client has one request in flight, so its own requests keep their order).  A request
        asking for it (``receipt``) is confirmed as soon as its tensors are in: a worker paces
        its pushes by these receipts (``gf/rcpt/{client}``)."""
        receipts: dist.Store | None = None  # this thread's own store connection
        while (item := peer.arriving.get()) is not None:  # type: ignore[union-attr]
            request = self._request(item[0], peer, item[1])
            if request is None:
                continue
            if request.get("receipt"):
                if receipts is None:
                    receipts = self.store.clone()
                receipt = {"seq": request.get("seq", -1), "inc": request.get("inc")}
                push_control(receipts, f"gf/rcpt/{request['client']}", receipt)
            self._work.put((request, None, None))

    def _request(self, msg: dict[str, Any], peer: Peer | None, finish: Any) -> dict | None:
        """The request with its tensors once they have arrived (None: the client died, or
        receiving them failed)."""
        if finish is None:
            return msg
        tensors = self._receiving(msg, peer, finish)
        if tensors is None:
            return None
        with self._peers_lock:  # waiting threads of several clients count here
            self.bytes_in += sum(t.numel() * t.element_size() for t in tensors)
        return join(msg, tensors)

    def _receiving(self, msg: dict[str, Any], peer: Peer | None, step: Callable[[], Any]) -> Any:
        """``step()`` (starting or finishing the receive of ``msg``'s tensors), or None if it
        failed.  A lost client: its pair is dropped (the others are served on).  A bug: logged
        with its traceback and sent to the client as the request's answer, which it raises as
        itself; its pair is dropped too, since what the link has posted is unknown."""
        try:
            return step()
        except Exception as exc:
            client = msg.get("client", "?")
            if lost_peer(exc):
                log.warning("server %s: receiving from %s failed, peer dropped: %s",
                            self.address, client, exc)  # fmt: skip
                self.drop(client, peer)
                return None
            log.error("server %s: receiving %r from %s failed (peer dropped)", self.address,
                      msg.get("op"), client, exc_info=exc)  # fmt: skip
            self.drop(client, peer)
            Reply(self, client, int(msg.get("seq", -1)), msg.get("inc")).send(error_reply(exc))
            return None

    def _handle(self) -> None:
        """The handling thread: every request once its tensors are in, ticks between them
        (in-process clients' requests, when the server is idle, on their own threads)."""
        while (item := self._work.get()) is not None:
            with self._handling:
                self._serve_item(*item)

    def _serve_item(self, msg: dict[str, Any], peer: Peer | None, finish: Any) -> None:
        """Call the handler (or the tick) for one request; the caller holds ``_handling``."""
        if msg.get("op") == "_tick":
            if self._tick is not None:
                self._tick()
            return
        request = self._request(msg, peer, finish)
        if request is None:
            return
        reply = Reply(self, msg.get("client", "?"), int(msg.get("seq", -1)), msg.get("inc"))
        self.deferred = []
        try:
            self._handler(request, reply)
        except Exception as exc:  # the error goes back to the caller, the server lives on
            if lost_peer(exc):  # a peer of the handler's own (a shard's chief, say) is gone
                log.warning("server %s: %r from %s failed: %s: %s", self.address,
                            msg.get("op"), msg.get("client"), type(exc).__name__, exc)  # fmt: skip
            else:  # a bug, or a request the handler refuses: the caller raises it as itself
                log.error("server %s: %r from %s failed", self.address, msg.get("op"),
                          msg.get("client"), exc_info=exc)  # fmt: skip
            reply.send(error_reply(exc))
        finally:
            deferred, self.deferred = self.deferred, None
            for client, message in deferred:
                self.post(client, message)

    def close(self) -> None:
        """Stop serving (pending clients get connection errors once the process exits)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        IN_PROCESS.pop(self.address, None)
        stopping = self.store.clone()  # (the receiving thread is blocked on self.store)
        # the store lives on until the process exits: a client connecting now learns from
        # this key that no one serves (see MailboxClient), instead of waiting out its timeout
        stopping.set(CLOSED, "1")
        push_control(stopping, REQUESTS, {"op": "_stop"})
        for thread in self._threads:
            thread.join(5)
        if self._tick is not None:
            self._ticker.join(5)
        for client in list(self.peers):
            self.drop(client)
