"""One worker's error latch: the errors of its threads, decided at one point.

A sharded worker runs two threads beside its own: overlap's pushes (:mod:`.early_pushes`) and
the taker of read-ahead answers (:mod:`.answer_taker`).  Neither may raise into the training
loop from its own thread, and neither may lose an error.  Each reports into the worker's one
:class:`ErrorLatch`: the first error is kept and logged once, at ERROR, naming the thread's
job (with its traceback when it is a bug rather than a lost peer); later ones (the same
failure seen again) only at DEBUG.  The worker's thread takes the kept error at the next step
boundary -- where it waits for that thread's work -- and raises it there, once.  An error the
worker's own thread meets in a step (a shard found unreachable) is decided here too
(:meth:`ErrorLatch.decide`), so one failure is logged once per worker whichever thread saw it
first; a bug a thread reported is raised in place of a lost peer's silence that follows it.
Nothing else holds a thread's error for later: a step whose reads failed
(:mod:`.pending_step`) and overlap's pushes remember only that they failed, the error itself
is the latch's.  The transport below only raises.
"""

from __future__ import annotations

import logging
import threading

from ...transport import lost_peer

__all__ = ["ErrorLatch"]

log = logging.getLogger(__name__)


class ErrorLatch:
    """The first error reported by ``worker``'s threads since it was last taken."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._taken: BaseException | None = None  # the last error taken (raised) from here

    def report(self, where: str, exc: BaseException) -> None:
        """A thread's ``exc`` while doing ``where`` (e.g. "the push to shard 2")."""
        with self._lock:
            known = exc is self._error or exc is self._taken  # logged when it came in
            first = self._error is None and not known
            if first:
                self._error = exc
        if first:
            trace = None if lost_peer(exc) else exc  # a bug's traceback says where it is
            log.error("worker rank %d: %s failed: %s", self.worker, where, exc, exc_info=trace)
        elif not known:
            log.debug("worker rank %d: %s failed as well: %s", self.worker, where, exc)

    @property
    def failed(self) -> bool:
        """Is an error kept (a thread failed since the last step boundary)?"""
        with self._lock:
            return self._error is not None

    def take(self) -> BaseException | None:
        """The kept error, now cleared (the caller raises it)."""
        with self._lock:
            exc, self._error = self._error, None
            if exc is not None:
                self._taken = exc
        return exc

    @property
    def last_raised(self) -> BaseException | None:
        """The last error taken from here (the one the worker raised)."""
        with self._lock:
            return self._taken

    def decide(self, where: str, exc: BaseException) -> BaseException:
        """The worker's own thread met ``exc`` while doing ``where`` and is about to raise:
        returns what it raises.  A bug a thread reported (a server's answer carrying its own
        error, after which that server stops answering) explains a lost peer's silence, so it
        is raised instead; otherwise ``exc``, logged here (once: not again if it is the error
        just taken from here, at DEBUG if a thread reported first).  Either way the kept
        error is cleared (the same failure, raised now)."""
        kept = self.take()
        if kept is not None and lost_peer(exc) and not lost_peer(kept):
            log.debug("worker rank %d: %s failed after the bug above: %s", self.worker, where, exc)
            return kept
        with self._lock:
            self._error = kept  # report() sees a thread's error came first: logs at DEBUG
        self.report(where, exc)
        self.take()
        return exc

    def raise_if_failed(self) -> None:
        """At a step boundary: raise the kept error, once."""
        exc = self.take()
        if exc is not None:
            raise exc
