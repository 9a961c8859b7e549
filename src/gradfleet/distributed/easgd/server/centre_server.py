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
* ``number``: the worker's count of its exchanges, on both requests.  A worker whose centre was
  lost sends its exchange again to the standby (:mod:`...hosting.standby`) under the same
  number: an add already applied is not applied again, and a read of an exchange already
  applied answers the ``c_read`` that add used (kept, per worker, while ``keep_reads``: on a
  replicated centre), so the worker moves exactly as it would have.
* ``barrier``:  TF's ``synchronous=True`` start-up barrier: held until ``num_worker`` arrived,
  or failed with a ``TimeoutError`` naming the missing ranks after ``timeout`` seconds.
* ``read`` / ``load``: the centre and counters; restore the centre from a checkpoint.
* ``done``:     the worker left (``forgotten``: another rank reports it dead for good).
* ``load_replica``: a new standby (:mod:`...hosting.standby`) starts from its primary's
  :meth:`CentreServer.replica_state`.  Reads answer where the standby is, so a worker follows
  one attached after its hello.
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

    # how a live standby (..hosting.standby) follows it: each worker sends its x to the
    # standby itself, and a read lost with the server is simply redone
    standby_direct = {"exchange_add": ("params",)}
    standby_early = ("exchange_read",)

    def __init__(
        self,
        centre: Sequence[torch.Tensor],
        num_worker: int,
        timeout: float,
        keep_reads: bool = False,
    ) -> None:
        self.centre = [c.detach().clone() for c in centre]
        # reused buffers (no page faults of a fresh model-sized tensor per exchange)
        self._diff = [torch.empty_like(c) for c in self.centre]
        # each worker's (exchange number, c_read) until its add (``keep_reads``: until its
        # next read, for an exchange sent again after the centre's loss)
        self.reads: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        self.applied: dict[int, Any] = {}  # each worker's last exchange number added
        self.resent: dict[int, int] = {}  # per worker: adds sent again, applied already
        self.keep_reads = keep_reads
        self.standby: str | None = None  # the standby's address, told in ``hello``
        self.standby_rank: int | None = None
        self.num_worker, self.timeout = num_worker, timeout
        self.exchanges: dict[int, int] = {}
        self.joins: dict[int, int] = {}
        self.members = Membership(num_worker, timeout, "EASGD centre")
        self.arrived: set[int] = set()
        self.barrier: list[tuple[int, Any, float]] = []

    def replica_state(self) -> dict[str, Any]:
        """Everything a new standby starts from (its ``load_replica``): the centre, each
        worker's last exchange applied and its kept read, the counters and who left."""
        return {
            "centre": [c.clone() for c in self.centre],
            "applied": {str(w): n for w, n in self.applied.items()},
            "reads": {str(w): [n, [c.clone() for c in r]] for w, (n, r) in self.reads.items()},
            "exchanges": {str(w): n for w, n in self.exchanges.items()},
            "joins": {str(w): n for w, n in self.joins.items()},
            "resent": {str(w): n for w, n in self.resent.items()},
            "left": sorted(self.members.left),
            "forgotten": sorted(self.members.forgotten),
        }

    def _load_replica(self, msg: dict[str, Any]) -> None:
        for c, v in zip(self.centre, msg["centre"], strict=True):
            c.copy_(v)
        self.applied = {int(w): n for w, n in msg["applied"].items()}
        self.reads = {int(w): (n, [r.clone() for r in rs]) for w, (n, rs) in msg["reads"].items()}
        for name in ("exchanges", "joins", "resent"):
            setattr(self, name, {int(w): n for w, n in msg[name].items()})
        self.members.left = {int(w) for w in msg["left"]}
        self.members.forgotten = {int(w) for w in msg["forgotten"]}

    def _standby(self) -> dict[str, Any]:
        """Where the standby is, told in hellos and reads."""
        return {"standby": self.standby, "standby_rank": self.standby_rank}

    def handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer]:
        if msg["op"] == "load_replica":  # a new standby starts from its primary's state
            self._load_replica(msg)
            return [Answer(ticket, {})]
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
            self.applied.pop(worker, None)  # (its numbers start again)
            return [Answer(ticket, {"centre": self.centre, **self._standby()})]
        number = msg.get("number")
        if op == "exchange_read":
            kept = self.reads.get(worker)
            if number is not None and self.applied.get(worker) == number and kept is not None:
                # sent again after the centre's loss, its add already applied: the same read
                return [Answer(ticket, {"centre": kept[1], **self._standby()})]
            # TF's read of the centre: the worker's d = x - c_read is completed by its
            # "exchange_add", which may come after other workers' reads and adds
            self.reads[worker] = (number, [c.clone() for c in self.centre])
            # where the standby is now: a worker follows one attached since its hello
            read = {"centre": self.reads[worker][1], **self._standby()}
            return [Answer(ticket, read, fresh=True)]
        if op == "exchange_add":
            if number is not None and self.applied.get(worker) == number:
                self.resent[worker] = self.resent.get(worker, 0) + 1
                log.info("EASGD centre: worker rank %d's exchange %s again: applied once "
                         "already", worker, number)  # fmt: skip
                return [Answer(ticket, {})]
            kept = self.reads.get(worker) if self.keep_reads else self.reads.pop(worker, None)
            if kept is None or kept[0] != number:
                raise ValueError(
                    f"ElasticAverageOptimizer: worker rank {worker} sent exchange_add"
                    f"{'' if number is None else f' {number}'} without an exchange_read "
                    "before it"
                )
            alpha = float(msg["alpha"])
            for c, x, r, d in zip(self.centre, msg["params"], kept[1], self._diff, strict=True):
                c.add_(torch.sub(x.to(c), r, out=d), alpha=alpha)  # TF's assign_add(alpha d)
            self.exchanges[worker] = self.exchanges.get(worker, 0) + 1
            self.applied[worker] = number
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
