"""The asynchronous EASGD centre as a state machine (TF's ``global_center_variable`` on a ps).

:class:`CentreServer` holds the centre ``c`` and the start-up barrier.  ``handle(request,
ticket)`` and ``tick()`` return :class:`~gradfleet.distributed.replies.Answer` objects and do
no I/O; :class:`~.async_centre.AsyncCentre` hosts it.  Requests:

* ``hello``:    check the worker's shapes; answer the centre (TF's init op: ``x := c``).
* ``exchange``: answer the centre ``c_read`` held now, then ``c := c + alpha (x - c_read)``
  (one atomic step: each exchange sees every earlier one).
* ``barrier``:  TF's ``synchronous=True`` start-up barrier: held until ``num_worker`` arrived,
  or failed with a ``TimeoutError`` naming the missing ranks after ``timeout`` seconds.
* ``read`` / ``load``: the centre and counters; restore the centre from a checkpoint.
* ``done``:     the worker left (``forgotten``: another rank reports it dead for good).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..membership import Membership
from ..replies import Answer, error

__all__ = ["CentreServer"]

log = logging.getLogger(__name__)


class CentreServer:
    """The centre variables and the start-up barrier (module docstring)."""

    def __init__(self, centre: Sequence[torch.Tensor], num_worker: int, timeout: float) -> None:
        self.centre = [c.detach().clone() for c in centre]
        # reused buffers (no page faults of a fresh model-sized tensor per exchange)
        self._diff = [torch.empty_like(c) for c in self.centre]
        self._spare = [torch.empty_like(c) for c in self.centre]
        self.num_worker, self.timeout = num_worker, timeout
        self.exchanges: dict[int, int] = {}
        self.joins: dict[int, int] = {}
        self.members = Membership(num_worker, timeout, "EASGD centre")
        self.arrived: set[int] = set()
        self.barrier: list[tuple[int, Any, float]] = []

    def handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer]:
        worker, op = int(msg["worker"]), msg["op"]
        if op == "done":
            self.members.leave(worker, forgotten=bool(msg.get("forgotten", False)))
            return [Answer(ticket, {})]
        self.members.heard(worker)
        if op == "hello":
            shapes = [list(c.shape) for c in self.centre]
            if [list(s) for s in msg["shapes"]] != shapes:
                raise ValueError(
                    f"ElasticAverageOptimizer: worker rank {worker} has parameter "
                    f"shapes {msg['shapes']}, the centre has {shapes}"
                )
            self.joins[worker] = self.joins.get(worker, 0) + 1
            if self.joins[worker] > 1:
                log.info(
                    "EASGD centre: worker rank %d rejoined (join %d)", worker, self.joins[worker]
                )
            self.members.hello(worker)
            return [Answer(ticket, {"centre": self.centre})]
        if op == "exchange":
            # the new centre goes to the spare buffers: the answer keeps the values read,
            # which the hosting code sends before the next request can move them
            read, alpha = self.centre, float(msg["alpha"])
            for c, x, d, new in zip(read, msg["params"], self._diff, self._spare, strict=True):
                torch.add(c, torch.sub(x.to(c), c, out=d), alpha=alpha, out=new)  # c + a(x - c)
            self.centre, self._spare = self._spare, read
            self.exchanges[worker] = self.exchanges.get(worker, 0) + 1
            return [Answer(ticket, {"centre": read})]
        if op == "barrier":
            self.arrived.add(worker)
            self.barrier.append((worker, ticket, time.monotonic()))
            if len(self.arrived) < self.num_worker:
                return []
            out = [Answer(t, {}) for _, t, _ in self.barrier]
            self.barrier = []
            return out
        if op == "read":
            values = {"centre": self.centre, "exchanges": self.exchanges, "joins": self.joins}
            return [Answer(ticket, values)]
        if op == "members":
            return [Answer(ticket, self.members.report())]
        if op == "load":
            for c, v in zip(self.centre, msg["centre"], strict=True):
                c.copy_(v)
            return [Answer(ticket, {})]
        raise ValueError(f"unknown request {op!r}")

    def tick(self, now: float | None = None) -> list[Answer]:
        """Fail the start-up barrier once it waited ``timeout`` seconds."""
        now = time.monotonic() if now is None else now
        if not self.barrier or now - self.barrier[0][2] <= self.timeout:
            return []
        missing = sorted(set(range(self.num_worker)) - self.arrived)
        message = (
            f"ElasticAverageOptimizer(synchronous=True): start-up barrier waited "
            f"{self.timeout:g}s; worker rank(s) {missing} never arrived"
        )
        log.error("%s", message)
        out = [error(t, "TimeoutError", message) for _, t, _ in self.barrier]
        self.barrier = []
        return out
