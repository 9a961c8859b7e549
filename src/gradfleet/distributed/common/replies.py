"""What the servers' state machines return: answers to requests, and effects.

A state machine (:class:`~.sync.chief.SyncChief`, :class:`~.sync.shards.ShardServer`,
:class:`~.easgd.centre_server.CentreServer`) is driven by ``handle(request, ticket)`` and
``tick()``; both return a list of outputs and do no I/O.  An :class:`Answer` answers the
request that came with ``ticket`` (an opaque object of the hosting code: the machine only
stores it, e.g. while a worker waits for a token, and hands it back).  Anything else in the
list is an effect for the hosting code to perform, in order (for example the shard's
``Applied`` report to the chief, which must precede the answer that follows it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DROPPED", "Answer", "error"]


@dataclass(frozen=True)
class Answer:
    """Send ``payload`` to the request of ``ticket``.  ``share``: a key promising that every
    answer with the same key carries the same tensor values (copied once for all).
    ``fresh``: the tensors are a snapshot the machine took for this answer and never changes
    (sent as they are, not copied again)."""

    ticket: Any
    payload: dict[str, Any]
    share: Any = None
    fresh: bool = False


def error(ticket: Any, kind: str, message: str) -> Answer:
    """An answer that raises ``kind`` (``"TimeoutError"``, ``"ServerUnreachable"``, ...) with
    ``message`` in the worker."""
    return Answer(ticket, {"error": kind, "message": message})


class _Dropped:
    """A ticket whose answers go nowhere: a standby's copy of a request (its primary answers
    the worker), or a request a new standby was given with its primary's state."""

    def send(self, payload: Any, share: Any = None, fresh: bool = False) -> None:
        pass


DROPPED = _Dropped()
