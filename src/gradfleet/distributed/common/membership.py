"""Which workers a server expects, has heard from, saw leave, and considers lost.

Every server (the SyncReplicas chief and shards, the asynchronous EASGD centre) serves workers
``0 .. N-1`` and must not stop while one of them may still come: :class:`Membership` is the one
record of that.  A worker is

* *expected* from the start, whether or not it has said ``hello`` yet;
* *seen* at its last message (``heard``);
* *left* once it said ``done`` or another rank forgot it (dead for good); a later ``hello``
  counts it again (a restarted worker);
* *silent* when it has not left and no message came for more than ``timeout`` seconds, counted
  from its last message or, for a worker never heard from, from the server's start.  The first
  time a worker turns silent it is logged as lost.

The server may stop (:meth:`finished`) once every expected worker has left or is silent.  Pure
bookkeeping: no I/O, no threads; the clock is injectable for tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    """Workers ``0 .. expected-1`` of the server named ``server`` (see module docstring)."""

    def __init__(
        self,
        expected: int,
        timeout: float,
        server: str = "server",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.expected, self.timeout, self.server, self.clock = expected, timeout, server, clock
        self.start = clock()
        self.last_seen: dict[int, float] = {}
        self.left: set[int] = set()
        self.forgotten: set[int] = set()
        self.lost: set[int] = set()  # silent workers already logged as lost

    def heard(self, worker: int) -> None:
        """A message from ``worker`` arrived now."""
        if worker in self.lost:
            self.lost.discard(worker)
            log.info("%s: worker rank %d is back after its silence", self.server, worker)
        self.last_seen[worker] = self.clock()

    def hello(self, worker: int) -> None:
        """``worker`` (re)joined: it is expected again even if it had left."""
        self.heard(worker)
        if worker in self.left:
            log.info("%s: worker rank %d joined again", self.server, worker)
        self.left.discard(worker)
        self.forgotten.discard(worker)

    def leave(self, worker: int, forgotten: bool = False) -> None:
        """``worker`` said ``done``, or (``forgotten``) another rank declared it dead for good."""
        if forgotten:
            self.forgotten.add(worker)
            log.info("%s: worker rank %d forgotten (reported dead for good)", self.server, worker)
        else:
            self.last_seen[worker] = self.clock()
            log.debug("%s: worker rank %d left", self.server, worker)
        self.left.add(worker)

    def silence(self, worker: int, now: float | None = None) -> float:
        """Seconds since ``worker``'s last message (since the start if it never sent one)."""
        now = self.clock() if now is None else now
        return now - self.last_seen.get(worker, self.start)

    def silent(self, now: float | None = None, busy: Iterable[int] = ()) -> list[int]:
        """Workers that have not left and are silent for over ``timeout`` seconds, except the
        ``busy`` ones (blocked in a request the server holds); newly silent ones are logged."""
        now = self.clock() if now is None else now
        busy = set(busy)
        out = [
            w
            for w in range(self.expected)
            if w not in self.left and w not in busy and self.silence(w, now) > self.timeout
        ]
        for w in out:
            if w not in self.lost:
                self.lost.add(w)
                seen = "never said hello" if w not in self.last_seen else "no message"
                log.warning(
                    "%s: worker rank %d lost: %s for %.1fs (timeout %gs)",
                    self.server, w, seen, self.silence(w, now), self.timeout,
                )  # fmt: skip
        return out

    def report(self, now: float | None = None) -> dict[str, Any]:
        """``{"silence": {worker: seconds}, "left": [...]}`` for the workers still expected."""
        now = self.clock() if now is None else now
        silence = {w: self.silence(w, now) for w in range(self.expected) if w not in self.left}
        return {"silence": silence, "left": sorted(self.left)}

    def finished(self, now: float | None = None) -> bool:
        """Every expected worker left or is silent: the server may stop."""
        gone = self.left | set(self.silent(now))
        return gone >= set(range(self.expected))
