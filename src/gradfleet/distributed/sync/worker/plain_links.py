"""A SyncReplicas worker's links in TF's protocol: push, token, read, one after the other.

The worker of one server, and every worker's bad-input step (``tag < 0``, reading ahead or
not).  Per step, TF's worker train op:

* :meth:`PlainLinks.push` -- shard k's gradients to shard k (``k >= 1``), all at once; then
  shard 0's (the chief's) with the token request, whose answer carries shard 0's new values
  when it stepped.  With overlap (one server), a gradient hook sends the token request with
  shard 0's gradients as soon as they are complete (:meth:`PlainLinks.push_early`);
* :meth:`PlainLinks.token_and_reads` -- the shards' answers to the push, collected while the
  chief works on the token; then every other shard's values that changed since the last read,
  all shards' replies received at once.  Returns a :class:`~.pending_step.FinishedStep`.

Replicated servers: the token request and every push carry the step's ``number``, and each
shard's gradients go to its standby first (:meth:`~.shard_clients.ShardClients.send_standby`;
not the chief's, whose copies carry what it made of them).  A shard whose standby is on this
worker's own rank is read there, not over its server's link (the chief's: its token answer
then brings no values, ``values=False``), and at the server if that standby is gone.
A server lost during overlap's early push is raised at ``token_and_reads``, on the worker's
thread, where the exchange moves to the standby and sends the step again
(:meth:`PlainLinks.reset`); a lost shard is raised as :class:`~.shard_clients.ShardLost` once
the other shards' answers are read, so that every link is in step for the step sent again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...transport import ServerUnreachable
from .answer_taker import Load
from .pending_step import FinishedStep
from .shard_clients import Grads, SendAgain, ShardClients, ShardLost, busy_error

__all__ = ["PlainLinks"]


class PlainLinks:
    """TF's protocol over ``clients`` (module docstring).  ``targets(k)``: shard ``k``'s
    tensors to receive its values into; ``load(k, values)``: what to do with them."""

    def __init__(
        self, clients: ShardClients, targets: Callable[[int], list[torch.Tensor]], load: Load
    ) -> None:
        self.clients, self.targets, self.load = clients, targets, load
        self._pending: list[int] = []  # shards whose push answers are not read yet
        self._token_sent = False  # the token request went out (the step's last push)
        self.shard_steps: list[int] = []  # each shard's step in its last push answer
        self.lost: ServerUnreachable | None = None  # the chief, lost in an early push
        self._values_apart = False  # the token answer brings no values: read at the standby

    def push(self, tag: int, parts: Sequence[Grads], extra: dict[str, Any]) -> bool:
        """Offer shard k's gradients to shard k, tagged ``tag`` (< 0: bad input, stale
        everywhere; the shard that holds it reports it), shard 0's with the token request.
        True iff every shard accepted them so far (else decided with the token).  ``extra``:
        what every push of the step carries (the worker's changed hyperparameters for
        dedicated servers; the update's R under ``replicas_to_aggregate="auto"``)."""
        for k in self.clients.shards:
            self._push_shard(k, tag, parts[k], extra)
        if tag < 0 and self.clients.shards:  # bad input: the shard holding it raises first
            accepted = self._pushed()
            chief = self.clients.chief
            chief.request("push", worker=self.clients.worker, tag=tag, grads=parts[0], **extra)
            return bool(chief.response()["accepted"]) and accepted
        self._request_token(tag, parts[0], extra)
        return True

    def push_early(self, jobs: dict[int, Grads], tag: int, extra: dict[str, Any]) -> None:
        """Overlap: the gradients of the shards in ``jobs`` are complete: out at once, shard
        0's with the token request."""
        for k, grads in jobs.items():
            try:
                if k != 0:
                    self._push_shard(k, tag, grads, extra)
                else:
                    self._request_token(tag, grads, extra)
            except ServerUnreachable as exc:  # from a gradient hook: raised by step()
                self.lost, self._token_sent = exc if k == 0 else ShardLost(k, str(exc)), True
                return

    def push_rest(self, rest: dict[int, Grads], tag: int, extra: dict[str, Any]) -> None:
        """Overlap, in ``step()``: the shards backward did not complete (``rest``) go now."""
        self.push_early(rest, tag, extra)

    def _push_shard(self, k: int, tag: int, grads: Grads, extra: dict[str, Any]) -> None:
        """Send shard ``k >= 1`` its gradients now; the answer is read with the token."""
        clients = self.clients
        data = clients.push_data(k, tag, grads)
        fields: dict[str, Any] = {"number": clients.number}
        if "grads" in data:  # at the shard's standby first, where there is one
            sent = clients.send_standby(data, k)
            if sent is not None:
                fields["standby"] = sent
        try:
            clients.clients[k].request("push", worker=clients.worker, tag=tag, **data, **extra,
                                       **fields)  # fmt: skip
        except ServerUnreachable as exc:
            raise ShardLost(k, str(exc)) from None
        self._pending.append(k)

    def _request_token(self, tag: int, grads: Grads | None, extra: dict[str, Any]) -> None:
        """Send the token request (with shard 0's gradients, if any); its answer is read by
        :meth:`token_and_reads`."""
        clients = self.clients
        fields: dict[str, Any] = {
            "worker": clients.worker, "tag": tag, "version": clients.versions[0],
            "number": clients.number,
        }  # fmt: skip
        # the chief's standby on this rank: its values are read there after the token
        self._values_apart = clients.local_standby(0) is not None
        if self._values_apart:
            fields["values"] = False
        if grads is not None:
            data = clients.push_data(0, tag, list(grads))
            if "grads" in data:  # at the chief's standby first, where there is one
                sent = clients.send_standby(data)
                if sent is not None:
                    fields["standby"] = sent
            fields.update(data)
            fields.update(extra)
        self.clients.chief.request("step", **fields)
        self._token_sent = True

    def _pushed(self) -> bool:
        """Read the answers to the shard pushes sent so far (in the order they were sent)."""
        pending, self._pending = self._pending, []
        if not pending:  # already read (a bad-input push): keep their steps
            return True
        replies, lost = {}, None
        for k in pending:
            try:
                replies[k] = self.clients.clients[k].response()
            except ServerUnreachable as exc:  # the others' answers are read all the same
                lost = lost or ShardLost(k, str(exc))
        if lost is not None:
            raise lost
        for k, reply in replies.items():
            self.clients.follow_standby(reply.get("standby"), reply.get("standby_rank"), k)
        self.shard_steps = [int(r.get("step", -1)) for r in replies.values()]
        return all(bool(r["accepted"]) for r in replies.values())

    def token_and_reads(self, tag: int) -> FinishedStep:
        """Wait for a token, then read every shard's values that changed since the last read;
        the chief's answer (``token``, ``accepted``, ``global_step``) as a finished step.  The
        token request is sent here unless the push sent it already (a bad-input step's goes
        without gradients).

        The reads go out as soon as the token's control part is in, while shard 0's values
        (which the chief sends with the token when they changed) are still travelling, and
        every reply's receive is posted before any is waited for: gloo moves a message only
        once its receive is posted, so every shard's link sends at once instead of one after
        another.  ``load(k, values)`` runs on shard k's values (views of the link's buffer,
        or of ``targets(k)`` where they were received in place) once they are in."""
        clients = self.clients
        if self.lost is not None:  # in overlap's early push
            lost, self.lost = self.lost, None
            self._token_sent = False
            raise lost
        if not self._token_sent:
            self._request_token(tag, None, {})
        self._token_sent = False
        shards_accepted = self._pushed()  # collected while the chief works on the token
        into = {k: self.targets(k) for k in clients.clients}
        apart = self._values_apart
        reply, chief_values = clients.chief.begin_response(
            receive_into=None if apart else into.get(0)
        )
        if "send_again" in reply:  # a shard's standby took over and withdrew our gradient
            chief_values()
            raise SendAgain(int(reply["send_again"]), reply.get("at"))
        finishes, lost = ([] if apart else [(0, chief_values)]), None
        # every read asked for before any answer; a shard whose standby is on this rank
        # (the chief's, when the token came without values) is read there
        readers = {k: clients.local_standby(k) or c for k, c in clients.shards.items()}
        if apart:
            readers = {0: clients.local_standby(0) or clients.chief, **readers}
        asked, again = [], []

        def failed(k: int, exc: ServerUnreachable) -> None:
            nonlocal lost
            # (the chief's values that came with its token have no reader: the chief is lost)
            reader = readers.get(k, clients.clients[k])
            if reader is not clients.clients[k]:  # the standby here is gone, not the server
                clients.standby_lost(k, exc)
                again.append(k)
            elif k == 0:
                raise exc
            else:
                lost = lost or ShardLost(k, str(exc))

        for k, client in readers.items():
            try:
                client.request("read", worker=clients.worker, version=clients.versions[k])
                asked.append(k)
            except ServerUnreachable as exc:  # the others' reads are finished all the same
                failed(k, exc)
        for k in asked:
            try:
                finishes.append((k, readers[k].begin_response(receive_into=into.get(k))[1]))
            except ServerUnreachable as exc:
                failed(k, exc)
        for k, finish in finishes:
            try:
                clients.loaded(k, finish(), self.load)
            except ServerUnreachable as exc:
                failed(k, exc)
        if lost is not None:
            raise lost
        if again:  # read at their servers instead
            clients.read(again, into, self.load)
        clients.follow_standby(reply.get("standby"), reply.get("standby_rank"))
        reply["accepted"] = bool(reply["accepted"]) and shards_accepted
        if clients.shards:
            # the chief may answer before the shards' "applied" reports reached it; every
            # shard had applied the steps its push answer showed
            done = min([int(reply["version"]), *self.shard_steps])
            reply["global_step"] = max(int(reply["global_step"]), done)
        return FinishedStep(reply)

    def reset(self) -> None:
        """Forget the step in flight (its server was lost): it is sent again whole."""
        self._pending, self._token_sent, self.lost = [], False, None

    @property
    def busy(self) -> bool:
        """Are this step's pushes or token request out, their answers not read?"""
        return bool(self._pending) or self._token_sent

    def check_idle(self, op: str) -> None:
        """A query between backward and ``step()`` with overlap would take the place of a
        push's answer on its link (one request at a time): refuse it."""
        if self.busy:
            raise busy_error(op)

    def leave(self, unreachable: str | None = None) -> None:
        """Say ``done`` to every server (``unreachable``: why, when a server is gone)."""
        self.clients.leave(unreachable)

    @property
    def bytes_out(self) -> int:
        return self.clients.bytes_out
