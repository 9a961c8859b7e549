"""A live standby of a server's state machine on another host: chain replication of requests.

A server whose host may be lost (the asynchronous EASGD centre) keeps a *standby*: the same
state machine, started from the same state, on another rank, ideally on another host.  The
*primary* forwards every request that may change its state to the standby and waits for the
standby to have handled it, and only then handles it itself and answers (the Parameter
Server's chain replication, Li et al. 2014, with a chain of two).  The machines are
deterministic given their requests in order, so the standby is bit-identical to its primary
after every request the primary answered, and holds at least every request a worker saw
answered.

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
  another host, else the next rank (pure).
* :class:`Forwarder` -- the primary's side: its client of the standby.
* :class:`StandbyRole` -- the standby's side: copies applied with their answers dropped, and
  the promotion.

:class:`~.hosted_server.HostedServer` owns either (``forward_to=`` / ``standby=``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..transport import MailboxClient, ServerUnreachable
from ..transport.errors import LINK_ERRORS

__all__ = ["COPY", "READ_ONLY", "Forwarder", "StandbyRole", "choose_standby"]

log = logging.getLogger(__name__)

COPY = "standby_copy"  # the op of a forwarded request; its own op travels as "copy_of"
READ_ONLY = frozenset({"read", "members"})  # requests that change nothing: not forwarded
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


class Forwarder:
    """The primary's client of its standby at ``address`` (module docstring)."""

    def __init__(self, address: str, name: str, timeout: float) -> None:
        self.name = name
        self.client: MailboxClient | None = MailboxClient(address, "primary", timeout, name)
        self.deposed: str | None = None  # set once the standby took over: every answer fails

    def forward(self, msg: dict[str, Any]) -> None:
        """Hand ``msg`` to the standby and wait until it was handled there; raises
        :class:`ServerUnreachable` once the standby has taken over (the primary must not
        handle it).  A lost standby is logged and the primary goes on alone."""
        if self.deposed is not None:
            raise ServerUnreachable(self.deposed)
        if self.client is None or msg["op"] in READ_ONLY:
            return
        fields = {k: v for k, v in msg.items() if k not in _MAILBOX_FIELDS}
        try:
            self.client.call(COPY, copy_of=msg["op"], **fields)
        except ServerUnreachable as exc:
            # the client's verdict: the standby is gone (an error reply raises as itself)
            log.warning("%s is lost; this server goes on without a standby: %s", self.name, exc)
            self.client = None
        except LINK_ERRORS as exc:
            log.warning("%s is lost; this server goes on without a standby: %s", self.name, exc)
            self.client = None
        except RuntimeError as exc:
            if not str(exc).startswith("StandbyPromoted"):
                raise
            self.deposed = f"{self.name} took over (this server was cut off from a worker)"
            log.warning("%s; this server answers no more requests", self.deposed)
            self.client = None
            raise ServerUnreachable(self.deposed) from None

    def close(self) -> None:
        self.client = None


class _Dropped:
    """The ticket of a forwarded copy: the standby's answers to it go nowhere."""

    def send(self, payload: Any, share: Any = None, fresh: bool = False) -> None:
        pass


class StandbyRole:
    """The standby's side (module docstring): :meth:`admit` sorts each request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.promoted = False

    def admit(self, msg: dict[str, Any]) -> tuple[dict[str, Any], Any] | None:
        """For a forwarded copy: the request as the primary got it and a ticket whose answers
        are dropped; None for a worker's own request (after which copies are refused).
        Raises ``StandbyPromoted`` (a ``RuntimeError`` the primary tells apart) for a copy
        that comes after the promotion."""
        if msg["op"] != COPY:
            if not self.promoted:
                self.promoted = True
                log.warning(
                    "%s takes over: worker client %r came to it (its primary is lost or cut off)",
                    self.name, msg.get("client"),
                )  # fmt: skip
            return None
        if self.promoted:
            raise RuntimeError(f"StandbyPromoted: {self.name} has taken over")
        original = {k: v for k, v in msg.items() if k not in _MAILBOX_FIELDS and k != "copy_of"}
        original["op"] = msg["copy_of"]
        return original, _Dropped()
