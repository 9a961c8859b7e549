"""What a lost peer raises, told apart from a bug; and a server's error as its client raises it.

A lost peer (dead, silent, or refusing) raises one of ``LINK_ERRORS``: a socket's ``OSError``
or one of torch.distributed's own errors (``DistError``: ``DistNetworkError``,
``DistStoreError``, NCCL's ``DistBackendError``).  Code that expects a peer's loss catches
those by name, so that a bug -- a ``TypeError``, a ``KeyError``, torch's ``RuntimeError`` for a
shape mismatch -- is raised as itself, never taken for a lost peer.  A client names the lost
server as :class:`ServerUnreachable`.

Gloo is the exception: its transport raises a *plain* ``RuntimeError``, the type a bug raises
too.  So every gloo call that talks to a peer runs under :func:`gloo_link`, which re-raises
gloo's transport error as :class:`LinkLost` (a ``ConnectionError``, so one of
``LINK_ERRORS``) naming the peer and the operation, and lets everything else through as it is.
What it takes for gloo's, measured with torch 2.13 (a 2-process experiment: one process
SIGKILLed, or silent, or its store's host killed):

* the peer died: ``send``, ``recv``, ``all_reduce``, and the waits of works posted before the
  death, all raise ``"[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
  [127.0.0.1]:55945. ..."`` (gloo's other I/O errors -- ``Read error``, ``writev``, ``Socket
  closed`` -- carry the same ``[file:line]`` prefix of a file under ``gloo/transport/``);
  except a receive whose message was on the wire when its sender died: it waits for the
  timeout, as for a silent peer (``pairs``: a client checks its server's store meanwhile);
* the peer is alive but silent: ``"[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out
  waiting 3000ms for recv operation to complete"``, then ``"Application timeout caused pair
  closure"`` (no prefix) from every later call on that pair;
* connecting to a peer that died after it published its address: ``"Gloo connectFullMesh
  failed with [.../gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection
  refused, ..."``; a peer that never comes: ``DistStoreError("wait timeout after 3000ms,
  ...")``;
* the store's host died: ``get``, ``set``, ``wait``, ``queue_pop``, ``queue_len``, ``check``
  raise ``DistNetworkError`` (``"Failed to recv, got 0 bytes..."``, ``"Broken pipe"``), a new
  store client ``DistNetworkError`` (``"The client socket has timed out ... while trying to
  connect"``); a connection refused to a plain socket is ``ConnectionRefusedError``.

Gloo's own consistency checks (``"[enforce fail at .../gloo/transport/tcp/pair.cc:456] ...
Received data size doesn't match expected size"``) are bugs: raised on gloo's loop thread they
abort the process, raised on the caller's they are not translated.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = [
    "LINK_ERRORS",
    "JobEnded",
    "LinkLost",
    "ServerClosed",
    "ServerUnreachable",
    "error_reply",
    "gloo_link",
    "is_gloo_link_error",
    "lost_peer",
    "remote_error",
]

LINK_ERRORS: tuple[type[Exception], ...] = (OSError, dist.DistError)


class ServerUnreachable(RuntimeError):
    """The server rank cannot be reached (dead, or no reply within the timeout)."""


class JobEnded(RuntimeError):
    """A restarted process came too late: the running job it would rejoin has ended (its
    group's other members have all left the group, or its server has stopped serving).  Not a
    lost peer and not a bug: there is nothing left to train."""


class ServerClosed(ServerUnreachable, JobEnded):
    """A client connecting to a server that has stopped serving (closed at the job's end)."""


class LinkLost(ConnectionError):
    """A gloo link's peer died, went silent or refused: gloo's transport error, named."""


def lost_peer(exc: BaseException) -> bool:
    """Does ``exc`` say that a peer is lost (one of ``LINK_ERRORS``, or a client's verdict
    :class:`ServerUnreachable`), rather than a bug?"""
    return isinstance(exc, (*LINK_ERRORS, ServerUnreachable))


# a "[file:line] " prefix of a file under gloo/transport/ (not "[enforce fail at ...]")
_GLOO_TRANSPORT = re.compile(r"\[(?!enforce fail)[^\]]*gloo/transport/[^\]]*:\d+\] ")
_GLOO_CLOSED = "Application timeout caused pair closure"


def is_gloo_link_error(exc: BaseException) -> bool:
    """Is ``exc`` gloo's transport saying its peer is gone or silent (module docstring)?"""
    if not isinstance(exc, RuntimeError) or isinstance(exc, dist.DistError):
        return False
    text = str(exc)
    return text.startswith(_GLOO_CLOSED) or _GLOO_TRANSPORT.search(text) is not None


@contextmanager
def gloo_link(peer: str, operation: str) -> Iterator[None]:
    """``with gloo_link(peer, operation):`` -- gloo's transport error inside becomes
    :class:`LinkLost` naming ``peer`` and ``operation`` (gloo's first line kept, the original
    chained); any other exception passes as itself."""
    try:
        yield
    except RuntimeError as exc:
        if not is_gloo_link_error(exc):
            raise
        first = str(exc).splitlines()[0]
        raise LinkLost(f"{peer}: {operation} failed: {first}") from exc


# --------------------------------------------------------------------- errors across the wire
_BY_NAME: dict[str, type[Exception]] = {
    "ServerUnreachable": ServerUnreachable,
    "LinkLost": LinkLost,
}


def error_reply(exc: BaseException) -> dict[str, str]:
    """A reply's payload that makes its client raise ``exc`` as itself (:func:`remote_error`)."""
    one = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else None
    return {"error": type(exc).__name__, "message": str(exc) if one is None else one}


def remote_error(kind: str, message: str) -> Exception:
    """The error a client raises for a server's error reply ``kind`` / ``message``: the same
    class for Python's built-in errors and this module's (a handler's ``TypeError`` is a
    ``TypeError`` at the caller), else a ``RuntimeError`` that names the class."""
    cls = _BY_NAME.get(kind) or getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # a class that wants other arguments (UnicodeDecodeError, ...)
            pass
    return RuntimeError(f"{kind}: {message}")
