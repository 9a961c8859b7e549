"""When each rank's process exited, as the kernel reports it, so that the launcher names the
rank that failed first.

The launcher polls its ranks every 0.1 s. When a worker of a lockstep job is killed, its peer
sees the broken connection and aborts a few milliseconds later, often inside the same polling
round; polled in rank order, the peer (rank 0) would then be named as the failure instead of
the rank that was killed. A thread waits on a pidfd per process (Linux 5.3 on) and notes the
moment each one exits, and the launcher handles the ranks that ended in one round in that
order. The report of a rank's exit can also reach the launcher a round after its peer's (it
travels through the forkserver): when a rank failed, the launcher first waits for the reports
of the ranks the kernel saw exit (:meth:`ExitTimes.exited`). Where pidfds are not available
the ranks keep their polling order.
"""

from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from collections.abc import Iterable

__all__ = ["ExitTimes"]

log = logging.getLogger(__name__)


class ExitTimes:
    """The moment (``time.monotonic()``) each of ``pids`` (rank -> process id) exited;
    :meth:`watch` adds a rank's new process (restarted by the launcher)."""

    def __init__(self, pids: dict[int, int]) -> None:
        self._times: dict[int, float] = {}
        self._ranks: dict[int, int] = {}  # pidfd -> rank
        self._noted = threading.Condition()
        self._poll = select.poll()
        self._closed = False
        self._thread: threading.Thread | None = None
        for rank, pid in pids.items():
            self.watch(rank, pid)

    def watch(self, rank: int, pid: int) -> None:
        """Note when ``pid``, now ``rank``'s process, exits (a time noted for the rank's
        earlier process is forgotten)."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError) as err:  # no pidfds here, or the process is gone
            log.debug("no exit time for rank %d (pid %d): %s", rank, pid, err)
            return
        with self._noted:
            self._times.pop(rank, None)
            self._ranks[fd] = rank
        self._poll.register(fd, select.POLLIN)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="gradfleet-exits", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        # a timeout, so that a process registered meanwhile and close() are seen
        while not self._closed:
            for fd, _ in self._poll.poll(200):
                now = time.monotonic()
                with self._noted:
                    self._times[self._ranks.pop(fd)] = now
                    self._noted.notify_all()
                self._poll.unregister(fd)
                os.close(fd)

    def close(self) -> None:
        """Stop watching (the launch is over)."""
        self._closed = True
        if self._thread is not None:
            self._thread.join(1.0)
        for fd in list(self._ranks):
            os.close(fd)
        self._ranks.clear()

    def exited(self) -> set[int]:
        """The ranks whose exit has been noted so far."""
        with self._noted:
            return set(self._times)

    def in_exit_order(self, ranks: Iterable[int], wait: float = 0.2) -> list[int]:
        """``ranks`` (processes that have exited) ordered by when they exited; the watching
        thread gets up to ``wait`` seconds to note them.  Ranks without a time (no pidfd)
        come last, in the order given."""
        ranks = list(ranks)
        with self._noted:  # a rank still in _ranks has exited, its time not yet noted
            self._noted.wait_for(lambda: not set(ranks) & set(self._ranks.values()), wait)
            times = dict(self._times)
        return sorted(ranks, key=lambda r: times.get(r, math.inf))
