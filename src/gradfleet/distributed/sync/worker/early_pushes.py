"""Overlap's pushes (``overlap=True``, reading ahead), sent by a thread of their own in the
worker's push order and paced like the pushes of ``step()``.

Why a thread: a gradient hook that sent its shard itself would either send every shard at once
(each worker's shards then share its link and all arrive at the end, and every worker pushes
the last layer's shard first, so all of them load one server's link while the others idle) or
wait for the servers' receipts to pace them, and a hook that waits holds backward up.  So a hook
only hands its shard over (:meth:`EarlyPushes.submit`) and backward goes on; this thread sends
the shards that are ready in the worker's push order (rotated by worker, see
:func:`~.shard_clients.push_order`), each when :class:`~.pacing.Pacing` gives it its turn, as
``step()`` does without overlap.  ``step()`` waits for it (:meth:`EarlyPushes.drain`) before it
sends the rest and asks for its token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .error_latch import ErrorLatch

__all__ = ["EarlyPushes"]

log = logging.getLogger(__name__)


class EarlyPushes:
    """Send each submitted shard with ``send(k, job)`` on one thread, the ready ones in the
    order of ``order``; the first error stops the sending, goes to ``latch`` and is raised by
    :meth:`drain` (or by whichever step boundary takes it from the latch first).  The latch
    is the one record of the failure: while it holds an error nothing more goes out, and
    once the error is taken (raised) the next step's pushes go out again."""

    def __init__(
        self, send: Callable[[int, Any], None], order: Sequence[int], latch: ErrorLatch
    ) -> None:
        self._send, self._latch = send, latch
        self._rank = {k: i for i, k in enumerate(order)}
        self._cond = threading.Condition()
        self._ready: dict[int, Any] = {}
        self._busy = False
        self._submitted = False  # a shard was handed over since the last drain()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gradfleet-pushes", daemon=True)
        self._thread.start()

    def submit(self, jobs: dict[int, Any]) -> None:
        """Send each shard ``k`` of ``jobs`` (``jobs[k]``: what ``send`` needs) once it is its
        turn; shards handed over together go out in push order among themselves."""
        with self._cond:
            self._submitted = True
            if not self._latch.failed:  # after an error nothing more goes out this step
                self._ready.update(jobs)
                self._cond.notify_all()

    def drain(self, timeout: float) -> None:
        """Until every submitted shard is sent; raises the first error a send raised (once,
        from the latch)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._ready and not self._busy, timeout):
                raise TimeoutError(f"overlap's pushes not sent after {timeout:g}s")
            self._submitted = False
        self._latch.raise_if_failed()

    @property
    def in_step(self) -> bool:
        """Was a shard handed over since the last :meth:`drain` (its push may not be out)?"""
        with self._cond:
            return self._submitted

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ready or self._stopping)
                if self._stopping:
                    return
                k = min(self._ready, key=lambda s: self._rank[s])
                job = self._ready.pop(k)
                self._busy = True
            try:
                self._send(k, job)
            except BaseException as exc:  # raised on the worker's thread by drain()
                self._latch.report(f"overlap's push to shard {k}", exc)
                with self._cond:
                    self._ready.clear()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
