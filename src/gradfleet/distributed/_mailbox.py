"""Request/reply messaging between workers and a server, on a c10d ``TCPStore``.

The server process hosts a ``torch.distributed.TCPStore`` (bound to loopback unless another host
is configured: the listening socket is created here and handed to the store) and serves one
request queue (``TCPStore.queue_push`` / ``queue_pop``) from a daemon thread.  A client pushes
``{"client", "seq", "op", ...}`` and pops its own reply queue.  A handler may answer later
(``Reply`` objects are kept until, e.g., a token exists), so blocking waits cost no thread.

Why the store and not ``torch.distributed.rpc``: a static RPC group cannot admit a restarted
process, a dynamic one makes every joiner call every member (a SIGKILLed member breaks the join
and leaves the membership token held) and ``rpc.shutdown`` waits for dead peers.  A store client
can (re)connect at any time, and a dead server turns into an immediate connection error.

Payloads are ``torch.save``'d and read back with ``torch.load(weights_only=True)`` (no pickle
from the network); sparse tensors travel as ``(indices, values, shape)``.  Payloads above
``CHUNK`` bytes are split into store keys (the store rejects values of ~8 MiB and more).
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MailboxServer", "MailboxClient", "Reply", "ServerUnreachable", "encode", "decode"]

REQUESTS = "gf/req"
CHUNK = 4 << 20
_SPARSE = "__sparse_coo__"


class ServerUnreachable(RuntimeError):
    """The server rank cannot be reached (dead, or no reply within the timeout)."""


# --------------------------------------------------------------------- encoding
def _pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse:
            obj = obj.coalesce()
            return {_SPARSE: True, "i": obj.indices(), "v": obj.values(), "shape": list(obj.shape)}
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack(v) for v in obj]
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get(_SPARSE):
            return torch.sparse_coo_tensor(obj["i"], obj["v"], obj["shape"]).coalesce()
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v) for v in obj]
    return obj


def encode(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(_pack(obj), buf)
    return buf.getvalue()


def decode(data: bytes) -> Any:
    return _unpack(torch.load(io.BytesIO(data), weights_only=True))


def _send(store: dist.Store, queue: str, data: bytes, tag: str) -> None:
    if len(data) <= CHUNK:
        store.queue_push(queue, b"I" + data)
        return
    keys = [f"gf/blob/{tag}/{i}" for i in range(0, len(data), CHUNK)]
    for k, i in zip(keys, range(0, len(data), CHUNK), strict=True):
        store.set(k, data[i : i + CHUNK])
    store.queue_push(queue, b"C" + encode(keys))


def _receive(store: dist.Store, queue: str) -> bytes:
    raw = store.queue_pop(queue)
    if raw[:1] == b"I":
        return raw[1:]
    parts = []
    for k in decode(raw[1:]):
        parts.append(store.get(k))
        store.delete_key(k)
    return b"".join(parts)


# --------------------------------------------------------------------- server
class Reply:
    """One pending answer to a client request; ``send`` it exactly once."""

    def __init__(self, server: MailboxServer, client: str, seq: int) -> None:
        self._server, self.client, self.seq, self.done = server, client, seq, False

    def send(self, payload: dict[str, Any]) -> None:
        if self.done:
            return
        self.done = True
        data = encode(dict(payload, seq=self.seq))
        _send(self._server.store, f"gf/rep/{self.client}", data, f"{self.client}/{self.seq}")


Handler = Callable[[dict[str, Any], Reply], None]


class MailboxServer:
    """Host a TCPStore and call ``handler(request, reply)`` for every request, in one thread.

    ``tick`` (if given) runs about every ``tick_s`` seconds on the same thread, so handler
    state needs no lock against it.  ``bytes_in`` counts received payload bytes.
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        tick: Callable[[], None] | None = None,
        tick_s: float = 0.1,
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
        self._handler, self._tick, self._tick_s = handler, tick, tick_s
        self._stopping = threading.Event()
        self.bytes_in = 0
        self._thread = threading.Thread(target=self._serve, name="gradfleet-server", daemon=True)
        self._thread.start()
        if tick is not None:
            self._ticker = threading.Thread(target=self._ticks, name="gradfleet-tick", daemon=True)
            self._ticker.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _ticks(self) -> None:
        poke = self.store.clone()
        while not self._stopping.wait(self._tick_s):
            poke.queue_push(REQUESTS, b"I" + encode({"op": "_tick"}))

    def _serve(self) -> None:
        while True:
            data = _receive(self.store, REQUESTS)
            self.bytes_in += len(data)
            msg = decode(data)
            op = msg.get("op")
            if op == "_stop":
                return
            if op == "_tick":
                if self._tick is not None:
                    self._tick()
                continue
            reply = Reply(self, msg.get("client", "?"), int(msg.get("seq", -1)))
            try:
                self._handler(msg, reply)
            except Exception as exc:  # the error goes back to the caller, the server lives on
                reply.send({"error": type(exc).__name__, "message": str(exc)})

    def close(self) -> None:
        """Stop serving (pending clients get connection errors once the process exits)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.store.clone().queue_push(REQUESTS, b"I" + encode({"op": "_stop"}))
        self._thread.join(5)
        if self._tick is not None:
            self._ticker.join(5)


# --------------------------------------------------------------------- client
_ERRORS = {
    "ValueError": ValueError,
    "FloatingPointError": FloatingPointError,
    "TimeoutError": TimeoutError,
    "RuntimeError": RuntimeError,
    "ServerUnreachable": ServerUnreachable,
}


class MailboxClient:
    """Talk to a :class:`MailboxServer` at ``address`` (``"host:port"``) as ``client``.

    ``call`` raises :class:`ServerUnreachable` naming ``server_name`` when the server is dead
    or silent for ``timeout`` seconds, and re-raises errors the handler reported.
    """

    def __init__(self, address: str, client: str, timeout: float, server_name: str) -> None:
        host, port = address.rsplit(":", 1)
        self.address, self.client, self.timeout, self.server_name = (
            address,
            client,
            timeout,
            server_name,
        )
        self.bytes_out = 0
        self._seq = 0
        self._broken: str | None = None
        try:
            self.store = dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=timeout)
            )
        except Exception as exc:  # refused / timed out
            raise ServerUnreachable(
                f"{server_name} at {address} is unreachable: {type(exc).__name__}: {exc}"
            ) from None
        # a restarted client reuses its name: forget replies meant for the previous incarnation
        while self.store.queue_len(f"gf/rep/{client}"):
            self.store.queue_pop(f"gf/rep/{client}", False)

    def call(self, op: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        if self._broken:
            raise ServerUnreachable(self._broken)
        self._seq += 1
        data = encode(dict(fields, op=op, client=self.client, seq=self._seq))
        self.bytes_out += len(data)
        wait = self.timeout if timeout is None else timeout
        start = time.monotonic()
        try:
            _send(self.store, REQUESTS, data, f"{self.client}/req{self._seq}")
            self.store.set_timeout(timedelta(seconds=wait))
            reply = decode(_receive(self.store, f"gf/rep/{self.client}"))
        except (dist.DistNetworkError, dist.DistStoreError, RuntimeError) as exc:
            late = time.monotonic() - start
            what = "closed the connection" if late < wait * 0.9 else f"sent no reply in {wait:g}s"
            self._broken = (
                f"{self.server_name} at {self.address} {what} during {op!r} "
                f"(dead or stuck): {type(exc).__name__}: {str(exc).splitlines()[0]}"
            )
            raise ServerUnreachable(self._broken) from None
        if "error" in reply:
            raise _ERRORS.get(reply["error"], RuntimeError)(reply["message"])
        return reply
