"""A SyncReplicas worker's links when reading ahead (several shards; the protocol:
:mod:`.read_ahead`): paced pushes, the token request alone, the shards' answers taken on a
thread of their own.

Per step:

* :meth:`ReadAheadLinks.push` -- every shard's push goes out in the worker's push order
  (:func:`~.shard_clients.push_order`), each when :class:`~.pacing.Pacing` gives it its turn,
  and the token request right after the push to shard 0 (alone, on a control-only link).  With
  overlap the gradient hooks hand complete shards to the pushing thread
  (:meth:`ReadAheadLinks.push_early`, :mod:`.early_pushes`), which sends them the same way;
* :meth:`ReadAheadLinks.token_and_reads` -- wait for the token while the
  :class:`~.answer_taker.AnswerTaker` takes each shard's answer (its new values); returns the
  :class:`~.pending_step.PendingStep` whose values are still coming in, waited for in
  ``step()`` or, streamed, by the next forward.

A bad-input step (``tag < 0``: a non-finite gradient under ``nonfinite="raise"``/``"drop"``)
goes through :class:`~.plain_links.PlainLinks` over the same clients: TF's protocol, whose
shard answers name the one that holds the bad gradient.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...transport import ServerUnreachable, lost_peer
from .answer_taker import AnswerTaker, Load
from .early_pushes import EarlyPushes
from .error_latch import ErrorLatch
from .pacing import Pacing
from .pending_step import PendingStep, Step
from .plain_links import PlainLinks
from .shard_clients import Grads, ShardClients, busy_error

__all__ = ["ReadAheadLinks"]

log = logging.getLogger(__name__)


class ReadAheadLinks:
    """Reading ahead over ``clients`` (module docstring).  ``targets(k)``: shard ``k``'s
    tensors to receive its values into; ``load(k, values)``: what to do with them (on the
    answer taker's thread); ``latch``: the worker's error latch, which the threads report to."""

    def __init__(
        self,
        clients: ShardClients,
        targets: Callable[[int], list[torch.Tensor]],
        load: Load,
        latch: ErrorLatch,
    ) -> None:
        self.clients, self.load, self.latch = clients, load, latch
        self.worker = clients.worker
        self.timeout = clients.timeout + 10.0
        self.taker = AnswerTaker(clients.clients, targets, load, latch)
        for client in clients.clients.values():  # releases must not connect to a dead server
            client.open_notes()
        self._token_link = clients.connect(0, "t", data=False)
        self.pacing = Pacing(clients.clients, clients.ranks, self.timeout)
        self._plain = PlainLinks(clients, targets, load)  # a bad-input step's protocol
        self._sent: dict[int, tuple[str, int]] = {}  # shard -> its push this step
        self._taking = False  # the taker has been told this step's pushes
        self._sent_lock = threading.Lock()  # _sent and _taking, for overlap's thread
        self._token_sent = False  # this step's token request is out
        self._early: EarlyPushes | None = None  # overlap's pushing thread, from its first push

    # ----------------------------------------------------------------- pushes
    def push(self, tag: int, parts: Sequence[Grads], extra: dict[str, Any]) -> bool:
        """Push every shard its gradients, tagged ``tag``, paced, in push order, and ask for
        the token right after shard 0's; True (the verdict comes with the answers).  ``tag <
        0`` (bad input): TF's protocol, where the shard that holds it reports it.  ``extra``:
        what every push of the step carries (the worker's changed hyperparameters for
        dedicated servers; the update's R under ``replicas_to_aggregate="auto"``)."""
        if tag < 0:
            return self._plain.push(tag, parts, extra)
        self.start_taking()
        try:
            for k in self.clients.order:
                self._send(k, (tag, parts[k], extra))
        except BaseException:
            self._abandon_step()
            raise
        return True

    def _send(self, k: int, job: tuple[int, Grads, dict[str, Any]]) -> None:
        """Push shard ``k`` its gradients (``job``: the tag, the gradients, what the push
        carries besides) once :class:`~.pacing.Pacing` gives it its turn (a large push asks
        for a receipt); the token request right after shard 0's.  The push is held by its
        shard until it can answer with the values of the update it could join
        (:mod:`.read_ahead`)."""
        tag, grads, extra = job
        self.pacing.wait_turn(k)
        client = self.clients.clients[k]
        data = self.clients.push_data(k, tag, grads)
        receipt = self.pacing.wants_receipt(k, data)
        follows = {"token_follows": True} if k == 0 else {}  # (the chief's placeholder)
        client.request(
            "push", worker=self.worker, tag=tag, **data,
            ahead=self.clients.versions[k], **extra,
            **({"receipt": True} if receipt else {}), **follows,
        )  # fmt: skip
        with self._sent_lock:  # start_taking() may run on the worker's thread meanwhile
            self._sent[k] = client.last_request
            if self._taking:
                self.taker.take(k)
        if receipt:
            self.pacing.sent(k, client.last_request[1])
        if k == 0:
            self._send_token(tag)

    def _send_token(self, tag: int) -> None:
        """The token request alone, on the control-only link (read-ahead brings the values)."""
        if self._token_sent:
            return
        inc, seq = self._sent[0]  # the chief serves it once this push to shard 0 is in
        self._token_link.request(
            "step", worker=self.worker, tag=tag, version=-1, values=False,
            after_inc=inc, after_seq=seq,
        )  # fmt: skip
        self._token_sent = True

    def push_early(self, jobs: dict[int, Grads], tag: int, extra: dict[str, Any]) -> None:
        """Overlap: the gradients of the shards in ``jobs`` are complete; they go to the
        pushing thread together (paced, in push order; :mod:`.early_pushes`)."""
        if self._early is None:  # only jobs with overlap need the thread
            self._early = EarlyPushes(self._send, self.clients.order, self.latch)
        self._early.submit({k: (tag, list(g), extra) for k, g in jobs.items()})

    def push_rest(self, rest: dict[int, Grads], tag: int, extra: dict[str, Any]) -> None:
        """Overlap, in ``step()``: backward is over, so the answers may be taken (in place)
        now; the shards it did not complete (``rest``) go out as the others did, and this
        waits until every push is sent (a failed one fails the step here)."""
        self.start_taking()
        if rest:
            self.push_early(rest, tag, extra)
        if self._early is None:
            return
        try:
            self._early.drain(self.timeout)
        except BaseException:
            self._abandon_step()
            raise

    def start_taking(self) -> None:
        """From now on the taker takes each push's answer (those sent so far first).  Overlap
        calls it at the start of ``step()``: backward is over, so the values may land in the
        parameters, and the shards pushed during backward answer while the rest go out; with
        streamed reads from the first push a gradient hook makes."""
        with self._sent_lock:  # overlap's pushing thread may be registering a push
            if self._taking:
                return
            self._taking = True
            for k in self._sent:
                self.taker.take(k)

    # ----------------------------------------------------------------- the token
    def token_and_reads(self, tag: int) -> Step:
        """Wait for the token; the shards' values are loaded as they come (``load`` on the
        taker's thread), and the returned :class:`~.pending_step.PendingStep` waits for some
        or all of them.  A bad-input step's reads are done here (a finished step)."""
        if tag < 0:
            return self._plain.token_and_reads(tag)
        self._send_token(tag)
        self._token_sent = False
        self.start_taking()
        sent, self._sent, self._taking = self._sent, {}, False
        self.pacing.clear()
        try:
            token = self._token_link.response()
        except BaseException as token_error:
            link_error = self._abandon(sent)
            # the token's error was a lost server and a shard's own link saw it die: say so
            # (a bug is raised as itself, whatever the links saw meanwhile)
            if link_error is not None and lost_peer(token_error):
                raise link_error from token_error
            raise
        if int(token["token"]) <= tag:  # a surplus token: the update may still wait for us
            self._release({k: p for k, p in sent.items() if k not in self.taker.answered})
        # else every shard applied the update our push could join, and answers it
        self.taker.close_step()
        return PendingStep(self.clients, self.taker, token, list(sent), self.load)

    # ----------------------------------------------------------------- a failed step
    def _abandon_step(self) -> None:
        """A push of this step failed: release what the shards hold and end the taker's step
        (the failed push's own error names its shard)."""
        sent, self._sent, self._taking = self._sent, {}, False
        self.pacing.clear()
        self._abandon(sent)

    def _abandon(self, sent: dict[int, tuple[str, int]]) -> ServerUnreachable | None:
        """The step failed (a push or the token): release what the shards hold of ``sent`` and
        let the taker finish the step, so that its thread is not left waiting on a connection
        that :meth:`leave` then uses, for answers that would come only with an update.
        Returns the ``ServerUnreachable`` a shard's own link raised meanwhile, if any."""
        self._release(sent)
        try:
            self.taker.end(self.timeout)
        except ServerUnreachable as link_error:
            return link_error
        except Exception as exc:  # the step's own error is the one raised
            log.info("worker rank %d: read-ahead after a failed step: %s", self.worker, exc)
        return None

    def _release(self, pushes: dict[int, tuple[str, int]]) -> None:
        """Tell the shards still holding this step's ``pushes`` that the token is here."""
        for k, (inc, seq) in pushes.items():
            try:
                self.clients.clients[k].notify(
                    "release", worker=self.worker, of_inc=inc, of_seq=seq
                )
            except ServerUnreachable as exc:  # a dead shard: its answer's receive reports it
                log.info("worker rank %d: release to shard %d failed: %s", self.worker, k, exc)

    # ----------------------------------------------------------------- the links
    @property
    def busy(self) -> bool:
        """Are this step's pushes out (or handed to overlap's thread), their answers not in?"""
        early = self._early is not None and self._early.in_step
        return bool(self._sent) or self._token_sent or early or self._plain.busy

    def check_idle(self, op: str) -> None:
        """A query between backward and ``step()`` with overlap would take the place of a
        push's answer on its link (one request at a time): refuse it."""
        if self.busy:
            raise busy_error(op)

    def leave(self, unreachable: str | None = None) -> None:
        """Stop overlap's pushing thread, say ``done`` to every server (``unreachable``: why,
        when a server is gone)."""
        if self._early is not None:
            self._early.close()
        self.clients.leave(unreachable)
        self.taker.stop()

    @property
    def bytes_out(self) -> int:
        return self._token_link.bytes_out + self.clients.bytes_out
