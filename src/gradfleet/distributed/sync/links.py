"""A SyncReplicas worker's connections to the servers: the chief (shard 0, tokens) and shards 1..

Per step, the protocol of TF's worker train op, one method each:

* :meth:`SyncLinks.push` -- shard k's gradients to shard k, all at once; shard 0's (the
  chief's) travel with the token request.  Reading ahead (several shards), every shard's
  push goes out on its own, large ones paced by the servers' receipts (:mod:`.ahead_links`).
  With overlap the optimizer hands each shard's gradients over from the gradient hooks
  (:meth:`~.ahead_links.ReadAheadLinks.push_early`) as soon as they are complete, and only
  the answers are awaited in the step;
* :meth:`SyncLinks.token_and_read` -- shard 0's gradients and the wait for a token in one
  request to the chief, while the other shards' answers to the push are collected (the
  token's answer carries shard 0's new values when it stepped); then every other shard's
  values that changed since the last read, all shards' replies received at once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..transport import MailboxClient
from .aggregator import all_finite
from .ahead_links import IN_FLIGHT, PACED_BYTES, ReadAheadLinks
from .answer_taker import AnswerTaker
from .error_latch import ErrorLatch
from .pieces import rank_places

__all__ = ["SyncLinks", "push_data", "push_order", "IN_FLIGHT", "PACED_BYTES"]

log = logging.getLogger(__name__)

Grads = list[torch.Tensor | None]


def push_order(ranks: Sequence[int], turn: int) -> list[int]:
    """The shards in the order a worker pushes them: every server rank's first shard, then
    every rank's second, ..., the ranks rotated by ``turn`` (the worker's number), so that at
    any moment the workers push to different server ranks (``[4, 5, 4, 5]``, turn 1 ->
    ``[1, 0, 3, 2]``).

    Shard 0 is never last: the token request follows the push to shard 0 at once, and it must
    reach the chief before this worker's last push can complete an update; else a faster
    worker could take the token meant for this one (TF hands tokens to whoever asks first),
    and a lockstep job (R = N, no initial tokens) would no longer run the same way twice."""
    hosts = list(dict.fromkeys(ranks))
    places = rank_places(ranks)
    order = sorted(
        range(len(ranks)),
        key=lambda k: (places[k], (hosts.index(ranks[k]) - turn) % len(hosts), k),
    )
    if len(order) > 1 and order[-1] == 0:
        order[-2:] = [0, order[-2]]
    return order


def push_data(
    tag: int, version: int, grads: Grads, shapes: Sequence[tuple[int, ...]] | None
) -> dict[str, Any]:
    """A push's data: ``{"grads": grads}``, or ``{"withheld": True}`` when its shard is certain
    to drop them as stale.

    TF's accumulators drop a gradient whose tag is below their step; a worker that has loaded
    the shard's values of step ``version`` > ``tag`` knows the shard is past ``tag`` (a shard's
    step never goes back, and a checkpoint load forgets the versions).  A backup worker, or
    one holding a surplus token, then sends a few bytes instead of gradients that would cross
    its link only to be dropped; the shard counts the push as dropped all the same
    (``GradientAggregator.drop_withheld``).  Gradients the shard should judge travel: bad
    input (``tag < 0``, NaN or Inf, which the shard reports under ``nonfinite="raise"`` or
    ``"drop"`` even when stale), shapes other than the shard's (``shapes``, from ``hello``),
    sparse ones."""
    stale = 0 <= tag < version and shapes is not None and len(shapes) == len(grads)
    if stale and all(
        g is None or (not g.is_sparse and tuple(g.shape) == tuple(s) and all_finite(g))
        for g, s in zip(grads, shapes, strict=True)
    ):
        return {"withheld": True}
    return {"grads": grads}


class SyncLinks(ReadAheadLinks):
    """Clients of the servers at ``addresses`` (shard order; ``ranks`` host them).
    ``targets(k)``/``load(k, values)``: shard ``k``'s tensors to receive into, and what to do
    with its new values (read-ahead answers are taken on a thread of their own)."""

    def __init__(
        self,
        addresses: Sequence[str],
        ranks: Sequence[int],
        worker: int,
        timeout: float,
        targets: Callable[[int], list[torch.Tensor]] | None = None,
        load: Callable[[int, list[torch.Tensor]], None] | None = None,
    ) -> None:
        self.worker, self.timeout = worker, timeout
        self.clients = {
            k: MailboxClient(
                a,
                f"w{worker}",
                timeout + 10.0,
                f"server rank {ranks[k]}" + (f" (shard {k})" if k else ""),
            )
            for k, a in enumerate(addresses)
        }
        self.versions = dict.fromkeys(self.clients, -1)
        self._shapes: dict[int, list[tuple[int, ...]]] = {}  # each shard's, from hello
        self.withheld = 0  # pushes sent without their gradients (push_data)
        self._carried: Grads | None = None  # one server: the push travels with the token request
        self._carried_extra: dict[str, Any] = {}
        self._pending: list[int] = []  # shards whose push answers are not read yet
        self._token_sent = False  # the token request went out early (overlap)
        self.shard_steps: list[int] = []  # each shard's step in its last push answer
        self.replicas: int | None = None  # the chief's R at hello
        self.order = push_order(ranks, worker)
        self._unreceived: deque[tuple[int, int]] = deque()  # (shard, request) sent, not in
        self.ahead = len(self.clients) > 1 and targets is not None and load is not None
        self._taker: AnswerTaker | None = None
        self._token_link: MailboxClient | None = None
        self._ahead_sent: dict[int, tuple[str, int]] = {}  # shard -> its push this step
        self._taking = False  # the taker has been told this step's pushes
        self._sent_lock = threading.Lock()  # _ahead_sent and _taking, for overlap's thread
        self._early = None  # overlap's pushing thread, started by its first push
        self.latch = ErrorLatch(worker)  # its threads' errors, raised at the step boundary
        if self.ahead:
            assert targets is not None and load is not None
            self._taker = AnswerTaker(self.clients, targets, load, self.latch)
            for client in self.clients.values():  # releases must not connect to a dead server
                client.open_notes()
            self._token_link = MailboxClient(
                addresses[0], f"w{worker}t", timeout + 10.0, f"server rank {ranks[0]}", data=False
            )

    @property
    def chief(self) -> MailboxClient:
        return self.clients[0]

    @property
    def shards(self) -> dict[int, MailboxClient]:
        return {k: c for k, c in self.clients.items() if k}

    def hello(self, parts: Sequence[Sequence[torch.Tensor]]) -> tuple[int, dict[int, list]]:
        """Join every server: ``(global_step, {shard: its current values})``."""
        out, step = {}, 0
        for k, client in self.clients.items():
            reply = client.call(
                "hello",
                worker=self.worker,
                shapes=[list(p.shape) for p in parts[k]],
                dtypes=[str(p.dtype) for p in parts[k]],
            )
            self.versions[k] = int(reply["version"])
            self._shapes[k] = [tuple(p.shape) for p in parts[k]]
            out[k] = reply["params"]
            step = int(reply["global_step"]) if k == 0 else step
            if k == 0:  # the R of the first update this worker's gradient may join
                self.replicas = reply.get("r")
        return step, out

    def push(self, tag: int, parts: Sequence[Grads], extra: dict[str, Any] | None = None) -> bool:
        """Offer shard k's gradients to shard k, tagged ``tag`` (< 0: bad input, stale
        everywhere; the shard that holds it reports it).  True iff every shard accepted them
        so far (one server: decided with the token).  ``extra``: what every push of the step
        carries (the worker's changed hyperparameters for dedicated servers; the update's R
        under ``replicas_to_aggregate="auto"``)."""
        extra = {} if extra is None else extra
        if self.ahead and tag >= 0:
            self.start_taking()
            try:
                for k in self.order:
                    self._push_paced(k, (tag, parts[k], extra))
            except BaseException:
                self._abandon_step()
                raise
            return True
        for k in self.shards:
            self.push_shard(k, tag, parts[k], extra)
        if tag < 0 and self.shards:  # bad input: the shard holding it raises first
            accepted = self._pushed()
            self.chief.request("push", worker=self.worker, tag=tag, grads=parts[0], **extra)
            return bool(self.chief.response()["accepted"]) and accepted
        self.carry(parts[0], extra)
        return True

    def push_shard(
        self, k: int, tag: int, grads: Grads, extra: dict[str, Any], receipt: bool = False
    ) -> None:
        """Send shard ``k`` its gradients now (``k >= 1`` unless reading ahead); the answer is
        read with the token.  ``receipt``: ask the shard to confirm the arrival (:meth:`_pace`)."""
        if self.ahead and tag >= 0:
            client = self.clients[k]
            data = self._push_data(k, tag, grads)
            receipt = receipt and client.receipts and "grads" in data
            follows = {"token_follows": True} if k == 0 else {}  # (the chief's placeholder)
            client.request(
                "push", worker=self.worker, tag=tag, **data, ahead=self.versions[k],
                **extra, **({"receipt": True} if receipt else {}), **follows,
            )  # fmt: skip
            with self._sent_lock:  # start_taking() may run on the worker's thread meanwhile
                self._ahead_sent[k] = client.last_request
                if self._taking:
                    assert self._taker is not None
                    self._taker.take(k)
            if receipt:
                self._unreceived.append((k, client.last_request[1]))
            return
        data = self._push_data(k, tag, grads)
        self.clients[k].request("push", worker=self.worker, tag=tag, **data, **extra)
        self._pending.append(k)

    def _push_data(self, k: int, tag: int, grads: Grads) -> dict[str, Any]:
        """:func:`push_data` for shard ``k``; a withheld push is counted and logged."""
        data = push_data(tag, self.versions[k], grads, self._shapes.get(k))
        if "withheld" in data:
            self.withheld += 1
            log.debug("worker rank %d: shard %d is at step %d: gradients of step %d withheld",
                      self.worker, k, self.versions[k], tag)  # fmt: skip
        return data

    def carry(self, grads: Grads, extra: dict[str, Any]) -> None:
        """Shard 0's gradients travel with the token request (:meth:`token_and_read`; reading
        ahead, every shard's push goes out on its own instead)."""
        self._carried, self._carried_extra = list(grads), extra

    def request_token(self, tag: int, grads: Grads | None, extra: dict[str, Any]) -> None:
        """Send the token request now (with shard 0's gradients, or the carried ones); its
        answer is read by :meth:`token_and_read`.  Overlap sends it from a gradient hook."""
        if self.ahead and tag >= 0:
            if grads is not None:
                self.push_shard(0, tag, grads, extra)
            self._send_token(tag)
            return
        fields: dict[str, Any] = {"worker": self.worker, "tag": tag, "version": self.versions[0]}
        if grads is None and self._carried is not None:
            grads, self._carried = self._carried, None
            extra = self._carried_extra
        if grads is not None:
            fields.update(self._push_data(0, tag, list(grads)))
            fields.update(extra)
        self.chief.request("step", **fields)
        self._token_sent = True

    def _read(
        self,
        shards: Sequence[int],
        into: dict[int, list[torch.Tensor]],
        load: Callable[[int, list[torch.Tensor]], None],
    ) -> None:
        """Read ``shards``' values that changed since the last read, all replies' receives
        posted before any is waited for."""
        for k in shards:
            self.clients[k].request("read", worker=self.worker, version=self.versions[k])
        reads = {k: self.clients[k].begin_response(receive_into=into.get(k)) for k in shards}
        for k, (_, finish) in reads.items():
            values = finish()
            self.versions[k] = int(values["version"])
            if "params" in values:
                load(k, values["params"])

    def _pushed(self) -> bool:
        """Read the answers to the shard pushes sent so far (in the order they were sent)."""
        pending, self._pending = self._pending, []
        if not pending:  # already read (a bad-input push): keep their steps
            return True
        replies = [self.clients[k].response() for k in pending]
        self.shard_steps = [int(r.get("step", -1)) for r in replies]
        return all(bool(r["accepted"]) for r in replies)

    def token_and_read(
        self,
        tag: int,
        into: dict[int, list[torch.Tensor]],
        load: Callable[[int, list[torch.Tensor]], None],
    ) -> dict[str, Any]:
        """Wait for a token, then read every shard's values that changed since the last read;
        returns the chief's answer (``token``, ``accepted``, ``global_step``).  The token
        request is sent here unless :meth:`request_token` sent it already.

        The reads go out as soon as the token's control part is in, while shard 0's values
        (which the chief sends with the token when they changed) are still travelling, and
        every reply's receive is posted before any is waited for: gloo moves a message only
        once its receive is posted, so every shard's link sends at once instead of one after
        another.  ``load(k, values)`` runs on shard k's values (views of the link's buffer,
        or of ``into[k]`` where they were received in place) once they are in."""
        if self.ahead and tag >= 0:
            return self._token_and_read_ahead(tag, load)
        if not self._token_sent:
            self.request_token(tag, None, {})
        self._token_sent = False
        shards_accepted = self._pushed()  # collected while the chief works on the token
        reply, chief_values = self.chief.begin_response(receive_into=into.get(0))
        for k, client in self.shards.items():
            client.request("read", worker=self.worker, version=self.versions[k])
        reads = {k: c.begin_response(receive_into=into.get(k)) for k, c in self.shards.items()}
        for k, finish in [(0, chief_values)] + [(k, f) for k, (_, f) in reads.items()]:
            values = finish()
            self.versions[k] = int(values["version"])
            if "params" in values:
                load(k, values["params"])
        reply["accepted"] = bool(reply["accepted"]) and shards_accepted
        if self.shards:
            # the chief may answer before the shards' "applied" reports reached it; every
            # shard had applied the steps its push answer showed
            done = min([int(reply["version"]), *self.shard_steps])
            reply["global_step"] = max(int(reply["global_step"]), done)
        return reply

    def forget_versions(self) -> None:
        """The next token and read bring every shard's values (after a checkpoint load)."""
        self.versions = dict.fromkeys(self.versions, -1)

    def call(self, shard: int, op: str, **fields: Any) -> dict[str, Any]:
        self._check_idle(op)
        return self.clients[shard].call(op, worker=self.worker, **fields)

    def call_all(self, op: str, **fields: Any) -> dict[int, dict[str, Any]]:
        self._check_idle(op)
        return {k: c.call(op, worker=self.worker, **fields) for k, c in self.clients.items()}

    def _check_idle(self, op: str) -> None:
        """A query between backward and ``step()`` with overlap would take the place of a
        push's answer on its link (one request at a time): refuse it."""
        early = self._early is not None and self._early.in_step
        if self._pending or self._token_sent or self._ahead_sent or early:
            raise RuntimeError(
                f"SyncReplicasOptimizer: {op!r} while this step's pushes are in flight "
                "(overlap=True pushes during backward): call it after step()"
            )

    def forget(self, ranks: Sequence[int]) -> None:
        """Tell every server that the workers ``ranks`` are dead for good."""
        for client in self.clients.values():
            for r in ranks:
                client.call("done", worker=r, forgotten=True)

    def leave(self) -> None:
        """Say ``done`` to every server; a server that is already gone is logged and skipped."""
        if self._early is not None:
            self._early.close()
        for k, client in self.clients.items():
            try:
                client.call("done", worker=self.worker, timeout=5.0)
            except Exception as exc:  # leaving must not fail: the server may have stopped
                log.info("worker rank %d: shard %d gone before its done: %s", self.worker, k, exc)

    @property
    def bytes_out(self) -> int:
        token = 0 if self._token_link is None else self._token_link.bytes_out
        return token + sum(c.bytes_out for c in self.clients.values())
