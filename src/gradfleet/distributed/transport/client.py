"""Request/reply between workers and a server, the client's side (see ``mailbox.py``).

A :class:`MailboxClient` connects to the server's ``TCPStore`` (control: JSON requests on
``gf/req``, replies on ``gf/rep/{client}``) and, for tensors, builds a gloo pair with the server
(:class:`~.pairs.PairLink`), or a :class:`~.pairs.LocalLink` when the server lives in this
process.  A dead or silent server becomes :class:`ServerUnreachable` naming it (only the
errors of ``LINK_ERRORS`` count: a bug in the call raises as itself), and an error a handler
raised is raised here as itself (``errors.remote_error``).

Its calls never log above DEBUG and it holds no error for later: once its server is lost the
client is dead (every later call raises at once, with the first cause), and the caller --
which knows what the server was for -- decides and logs.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import LINK_ERRORS, ServerClosed, ServerUnreachable, remote_error
from .mailbox import CLOSED, IN_PROCESS, REQUESTS, MailboxServer, pair_failure, push_control
from .pairs import SERVER, LocalLink, PairLink, local_address_towards
from .peer import LAYOUT
from .wire import Packer, dumps, join, loads, split

__all__ = ["MailboxClient", "store_client"]

log = logging.getLogger(__name__)

PROBE_S = 10.0
"""How long a check that the server lives waits for its store's answer before the server
counts as silent (the store answers from a thread of its own, in milliseconds when alive)."""


def store_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A store client of the server at ``host:port``; a refused connection raises at once.

    A store client retries a refused connection for its whole ``timeout``, as it must while a
    job starts.  A server's address is shared only once it listens, so here a refusal means
    the server is gone: the caller hears so now instead of ``timeout`` seconds later.  A
    connection that is slow rather than refused (a loaded or distant host) is left to the
    store client's own timeout."""
    try:
        with socket.create_connection((host, port), timeout=min(timeout, 5.0)):
            pass
    except ConnectionRefusedError:
        raise ConnectionRefusedError(f"connection to {host}:{port} refused") from None
    except OSError:
        pass
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


class MailboxClient:
    """Talk to a :class:`MailboxServer` at ``address`` (``"host:port"``) as ``client``.

    ``call`` (= ``request`` then ``response``) raises :class:`ServerUnreachable` naming
    ``server_name`` when the server is dead or silent for ``timeout`` seconds, and raises
    an error the handler raised as itself.  ``data=False``: control messages only (no pair group).
    ``in_process=False``: a gloo pair even when the server lives in this process.
    """

    def __init__(
        self,
        address: str,
        client: str,
        timeout: float,
        server_name: str,
        data: bool = True,
        in_process: bool = True,
    ) -> None:
        host, port = address.rsplit(":", 1)
        self.address, self.client, self.timeout = address, client, timeout
        self.server_name = server_name
        self.bytes_out = 0
        self._seq = 0
        self._pending: tuple[str, float, float] | None = None
        self._dead: str | None = None
        self.inc = uuid.uuid4().hex
        self.link: PairLink | LocalLink | None = None
        self._notes: dist.Store | None = None  # a second connection: notify(), receipts
        self._probe: dist.Store | None = None  # a third: is the server alive (_alive)
        self._outbox, self._inbox = Packer(), Packer()
        # a server in this process: control skips the store (``MailboxServer.submit``)
        self._local: MailboxServer | None = None
        self._replies: queue.SimpleQueue | None = None
        try:
            self.store = store_client(host, int(port), timeout)
            if self.store.check([CLOSED]):  # not a link error: passes the except below
                raise ServerClosed(f"{server_name} at {address} has stopped serving")
            # a restarted client reuses its name: forget replies meant for the previous one
            while self.store.queue_len(f"gf/rep/{client}"):
                self.store.queue_pop(f"gf/rep/{client}", False)
            server = IN_PROCESS.get(address) if in_process else None
            if server is not None and server.pid == os.getpid():
                self._local = server
                server_end = None
                if data:
                    server_end, self.link = LocalLink.pair()
                self._replies = server.connect_local(client, self.inc, server_end)
            elif data:
                self.link = self._pair(host, timeout)
        except LINK_ERRORS as exc:  # refused / timed out / stopped serving
            log.warning("%s at %s is unreachable: %s", server_name, address, exc)
            raise ServerUnreachable(
                f"{server_name} at {address} is unreachable: {type(exc).__name__}: {exc}"
            ) from None

    def _pair(self, host: str, timeout: float) -> PairLink:
        """Ask the server for a pair and build this side of it; a bug that kept the server
        from building its side is raised here as itself, once this side gave up."""
        hello = {"op": "_pair", "client": self.client, "inc": self.inc}
        bind = local_address_towards(host)
        push_control(self.store, REQUESTS, dict(hello, host=bind))
        prefix = f"gf/pair/{self.client}/{self.inc}"
        name = f"{self.server_name} at {self.address}"
        try:
            return PairLink(self.store, prefix, 1 - SERVER, bind, timeout, name)
        except LINK_ERRORS:
            if self.store.check([pair_failure(prefix)]):
                failure = loads(self.store.get(pair_failure(prefix)))
                raise remote_error(failure["error"], failure["message"]) from None
            raise

    def request(self, op: str, timeout: float | None = None, **fields: Any) -> None:
        """Send one request (tensors start travelling at once); :meth:`response` waits."""
        if self._dead:
            raise ServerUnreachable(self._dead)
        self._seq += 1
        skeleton, tensors = split(fields)
        message = dict(skeleton, op=op, client=self.client, seq=self._seq, inc=self.inc)
        wait = self.timeout if timeout is None else timeout
        self._pending = (op, wait, time.monotonic())
        try:
            if tensors:
                if self.link is None:
                    raise ValueError("this MailboxClient was made with data=False")
                self.link.wait_sent()
                # large tensors go as they are: the caller waits for the reply, by which time
                # the server has received them
                message[LAYOUT], messages = self._outbox.pack(tensors, direct=True)
                self.link.send(messages)
                self.bytes_out += sum(m.numel() for m in messages)
            self.bytes_out += self._control(self.store, message)
        except LINK_ERRORS as exc:
            self._fail(exc)

    def _control(self, store: dist.Store | None, message: dict[str, Any]) -> int:
        """Send a control message: handed to an in-process server, else through ``store``."""
        if self._local is None:
            assert store is not None
            return push_control(store, REQUESTS, message)
        data = dumps(message)
        self._local.submit(data)
        return len(data)

    def _next_reply(self, wait: float) -> dict[str, Any]:
        """The next reply's control part: from the in-process queue, else the store's."""
        if self._replies is None:
            return loads(self.store.queue_pop(f"gf/rep/{self.client}"))
        try:
            return loads(self._replies.get(timeout=wait))
        except queue.Empty:
            raise TimeoutError(f"no reply in {wait:g}s") from None

    @property
    def last_request(self) -> tuple[str, int]:
        """``(incarnation, number)`` of the last request: what a :meth:`notify` can name."""
        return self.inc, self._seq

    def open_notes(self) -> None:
        """Open :meth:`notify`'s connection now, while the server is known to be alive (a
        store client connecting to a dead server retries until its timeout)."""
        if self._notes is None:
            self._notes = self.store.clone()

    def notify(self, op: str, **fields: Any) -> None:
        """Send a control message that gets no reply, also while a request waits for its
        reply (for example "release the push I sent").  It goes on a connection of its own:
        the store client may be blocked in the reply's ``queue_pop`` on another thread."""
        if self._dead:
            raise ServerUnreachable(self._dead)
        try:
            message = dict(fields, op=op, client=self.client, inc=self.inc, seq=-1)
            if self._local is None:
                self.open_notes()
            self.bytes_out += self._control(self._notes, message)
        except LINK_ERRORS as exc:
            self._fail(exc)

    @property
    def receipts(self) -> bool:
        """Does the server confirm a request's tensors' arrival when asked (``receipt=True``
        among its fields)?  Not in-process: there the tensors are handed over at once."""
        return isinstance(self.link, PairLink)

    def wait_receipt(self, seq: int, timeout: float) -> None:
        """Until the server has received the tensors of request ``seq`` (sent with
        ``receipt=True``; earlier receipts are skipped).  Why not the send's completion: the
        kernel's socket buffers take megabytes at once, long before the bytes are across."""
        if self._dead:
            raise ServerUnreachable(self._dead)
        start = time.monotonic()
        try:
            self.open_notes()
            assert self._notes is not None
            self._notes.set_timeout(timedelta(seconds=timeout))
            while True:
                got = loads(self._notes.queue_pop(f"gf/rcpt/{self.client}"))
                if got.get("inc") == self.inc and int(got["seq"]) >= seq:
                    return
        except LINK_ERRORS as exc:
            self._fail(exc, ("receipt", timeout, start))

    def response(self, receive_into: Sequence[Any] | None = None) -> dict[str, Any]:
        """The reply to the last :meth:`request` (tensors are views: copy what you keep).

        ``receive_into``: tensors of the caller's for the reply's tensors (in the order they
        appear in the reply); a large one that matches in dtype and shape is received
        straight into it, and the reply then holds a view of it (check with
        ``data_ptr()`` before copying)."""
        return self.begin_response(receive_into)[1]()

    def begin_response(
        self, receive_into: Sequence[Any] | None = None
    ) -> tuple[dict[str, Any], Callable[[], dict[str, Any]]]:
        """:meth:`response` in two halves: wait for the reply's control part and start
        receiving its tensors; returns that part (without tensors) and a function that
        waits for them and gives the whole reply.

        Why: gloo sends a message only once its receiver has posted the receive, so a
        caller waiting on several servers posts every receive first (:meth:`begin_response`
        on each), then finishes them; received one after another, every client would drain
        the servers in the same order, one server's link busy at a time.  An error reply
        raises here (it carries no tensors)."""
        assert self._pending is not None, "response() without request()"
        if self._dead:
            raise ServerUnreachable(self._dead)
        op, wait, start = self._pending
        try:
            self.store.set_timeout(timedelta(seconds=wait))
            while True:
                reply = self._next_reply(wait)
                if reply.get("inc") != self.inc:
                    continue  # meant for an earlier incarnation (its tensors went to its pair)
                if reply.get("seq") == self._seq:
                    break
                if LAYOUT in reply and self.link is not None:  # an abandoned request's answer:
                    self.link.receive(reply[LAYOUT], self._inbox)  # drain its tensors
            layout = reply.pop(LAYOUT, None)
            receiving = None
            if layout is not None:
                assert self.link is not None
                alive = None
                if self._local is None:
                    if self._probe is None:  # opened now: the server just answered
                        self._probe = self.store.clone()
                        self._probe.set_timeout(timedelta(seconds=min(self.timeout, PROBE_S)))
                    alive = self._alive
                receiving = self.link.begin_receive(layout, self._inbox, receive_into, alive)
        except LINK_ERRORS as exc:
            self._fail(exc)
        self._pending = None
        if "error" in reply:  # the handler's error, as itself
            raise remote_error(reply["error"], reply["message"])

        def finish() -> dict[str, Any]:
            if receiving is None:
                return reply
            try:
                return join(reply, receiving())
            except LINK_ERRORS as exc:
                self._pending = (op, wait, start)
                self._fail(exc)
                raise  # unreachable: _fail raises

        return dict(reply), finish

    def close(self) -> None:
        """Done with this server: end the link's waiting thread (idle now; left running, it is
        one more thread a peer's exit could wake during the interpreter's finalization).  The
        link's groups stay until the process exits: a receive posted ahead may be pending on
        them."""
        if isinstance(self.link, PairLink):
            self.link.stop_waiting()

    def _alive(self) -> None:
        """Raise one of ``LINK_ERRORS`` if the server is gone: a round trip to its control
        store, answered by the store's own thread however busy the server is. A dead server's
        connection is closed (raised at once); a silent one answers nothing (raised after
        ``PROBE_S`` s). Why: gloo does not wake a receive whose sender died mid-message
        (``pairs`` module docstring)."""
        assert self._probe is not None
        if self._probe.check([CLOSED]):
            raise ConnectionError("it has stopped serving")

    def call(
        self,
        op: str,
        timeout: float | None = None,
        receive_into: Sequence[Any] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        self.request(op, timeout, **fields)
        return self.response(receive_into)

    def _fail(self, exc: Exception, pending: tuple[str, float, float] | None = None) -> None:
        """The server is lost (``exc``: one of ``LINK_ERRORS``): the client is dead from now
        on, with this first cause (later calls fail at once); the caller decides and logs."""
        if self._dead is None:
            op, wait, start = pending or self._pending or ("?", self.timeout, time.monotonic())
            late = time.monotonic() - start
            what = "closed the connection" if late < wait * 0.9 else f"sent no reply in {wait:g}s"
            first = str(exc).splitlines()[0] if str(exc) else ""
            self._dead = (
                f"{self.server_name} at {self.address} {what} during {op!r} "
                f"(dead or stuck): {type(exc).__name__}: {first}"
            )
            log.debug("%s", self._dead)
        raise ServerUnreachable(self._dead) from None
