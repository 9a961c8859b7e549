"""The asynchronous EASGD centre as a state machine (TF's ``global_center_variable`` on a ps).

:class:`CentreServer` holds the centre ``c`` and the start-up barrier.  ``handle(request,
ticket)`` and ``tick()`` return :class:`~gradfleet.distributed.common.replies.Answer` objects and do
no I/O; :class:`~.async_centre.AsyncCentre` hosts it.  Requests:

* ``hello``:    check the worker's shapes; answer the centre (TF's init op: ``x := c``).
* ``exchange_read``: answer the centre ``c_read`` held now (TF's read of the centre) and keep
  it for this worker;
* ``exchange_add``:  the worker's ``x``: ``c := c + alpha (x - c_read)`` (TF's
  ``assign_add(alpha d)``).  Other workers' reads and adds may come between a worker's two
  requests, as between TF's read and ``assign_add`` (not atomic across workers): the
  worker sends ``x`` while ``c_read`` travels to it, so an exchange costs one transfer time,
  both directions of the link busy at once, not two.
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

from ...common.membership import Membership
from ...common.replies import Answer, error

__all__ = ["CentreServer"]

log = logging.getLogger(__name__)


class CentreServer:
    """The centre variables and the start-up barrier (module docstring)."""

    def __init__(self, centre: Sequence[torch.Tensor], num_worker: int, timeout: float) -> None:
        self.centre = [c.detach().clone() for c in centre]
        # reused buffers (no page faults of a fresh model-sized tensor per exchange)
        self._diff = [torch.empty_like(c) for c in self.centre]
        self.reads: dict[int, list[torch.Tensor]] = {}  # each worker's c_read until its add
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
            self.reads.pop(worker, None)  # a restarted worker's unfinished exchange
            return [Answer(ticket, {"centre": self.centre})]
        if op == "exchange_read":
            # TF's read of the centre: the worker's d = x - c_read is completed by its
            # "exchange_add", which may come after other workers' reads and adds
            self.reads[worker] = [c.clone() for c in self.centre]
            return [Answer(ticket, {"centre": self.reads[worker]}, fresh=True)]
        if op == "exchange_add":
            read = self.reads.pop(worker, None)
            if read is None:
                raise ValueError(
                    f"ElasticAverageOptimizer: worker rank {worker} sent exchange_add without "
                    "an exchange_read before it"
                )
            alpha = float(msg["alpha"])
            for c, x, r, d in zip(self.centre, msg["params"], read, self._diff, strict=True):
                c.add_(torch.sub(x.to(c), r, out=d), alpha=alpha)  # TF's assign_add(alpha d)
            self.exchanges[worker] = self.exchanges.get(worker, 0) + 1
            return [Answer(ticket, {})]
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
