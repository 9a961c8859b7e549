"""The SyncReplicas chief: shard 0's server plus TF's chief sync op and token line.

:class:`SyncChief` is a :class:`~.shards.ShardServer` for shard 0 (every variable when
unsharded) to which it adds ``global_step``, the :class:`~.token_line.TokenLine` and each
update's R (:class:`~.replica_choice.ReplicaChoice`).  It is a state machine: ``handle(request,
ticket)`` and ``tick()`` return :class:`~gradfleet.distributed.common.replies.Answer` objects (and
effects), one request at a time (the hosting server never overlaps two calls), so it needs no
lock and does no I/O.  What it adds to a shard's handling:

* ``hello``:  the shard's answer plus ``global_step`` (TF's ``local_step_init_op``:
  ``local_step := global_step``) and the R of the update at it.
* ``push``:   (sharded jobs) the shard's push; with ``token_follows`` its worker takes its place
  in the token line at once, and a token request that overtook its push goes on
  (:mod:`.token_requests`).
* ``step``:   push the gradients (if given) with the worker's tag; then answer with a token
  once the token line's rule allows (:mod:`.token_line`: one gradient per worker per update, or
  TF's shared queue of ``max(N, R)`` tokens per update) and the current variables (not with
  ``values=False``: a token request that travels apart from the push, whose answer brings the
  values).  When the live workers can never make the pending update, every worker in line
  gets the reason.
* ``applied``: a shard server finished an update (sharded jobs).
* ``done``:   the worker left (``forgotten``: another rank reports it dead for good).
* ``tick``:   a worker that waited ``timeout`` seconds for a token gets a ``TimeoutError``
  naming the ranks it is waiting for (silent ones), never a silent hang; under
  ``replicas_to_aggregate="auto"`` a worker far behind lowers the pending update's R.

Shard 0's update (its R gradients in) is TF's chief sync op for its variables; with parameter
shards the chief learns the other shards' updates from their ``applied`` reports and sets
``global_step`` to the minimum shard step (tokens after every increment).  The hosting code
watches the shard servers; :meth:`SyncChief.unreachable` then answers every waiting and later
request with ``ServerUnreachable`` naming the dead one, and :meth:`SyncChief.fail` with the
error itself when the watching failed for another reason (a bug): the chief's one decision that
it cannot go on, whose first cause is kept (``broken``) and logged once.

``last_step`` (beyond TF): once ``global_step`` reaches it every token request is answered at
once, so no worker blocks at the end of training (TF's end-of-training hangs, #7970).

A live standby (:mod:`...hosting.standby`, beyond TF): the chief is deterministic given its
requests in order, so a copy on another host that handles the same requests stays
bit-identical to it.  For that a worker numbers its step requests (``number``), and a step
request sent again under the same number -- its worker moved here after the primary's loss --
is never applied twice: it takes over its place in the token line if it still waits there, or
gets the answer it was given (the token, its verdict; the values as they are now).  The
gradients never travel twice: a step's copy leaves them out (``standby_replaced``) and carries
what the primary decided from them instead (:meth:`SyncChief.copy_fields`): the verdict on
them (accepted, stale, non-finite), and with the copy of the request that made an update, that
update's averages, which the standby applies as they are.  So the primary's link carries one
average per update to the standby, not every worker's gradients.  The standby only counts the
pending update's gradients; when it takes over (:meth:`SyncChief.take_over`) it withdraws
them, and each of their workers, which waits for that update under the one-gradient-per-worker
rule, offers its gradient again with the step it sends again (an update the primary made but
answered no one for is made again, from the gradients that come).  Under TF's shared token
queue a worker may go on before the update its gradient joined, so there the workers send
their gradients to the standby themselves (``standby_direct``).  A new standby starts from
:meth:`SyncChief.replica_state` (``load_replica``).  Hyperparameters then come with
the workers' pushes on both copies (as on a dedicated server), never from one host's own
optimizer, whose LR schedule may be at another point.  Under a chosen R
(``replicas_to_aggregate="auto"``) the choice depends on the primary's clock: each copy
carries its primary's choices (:meth:`SyncChief.copy_fields`, read by the standby's
:class:`~..common.replica_choice.ReplicaChoice`), and an R the primary lowers on a tick
reaches the standby as a request of its own (``lower``, :meth:`SyncChief.tick_requests`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ...common.membership import Membership
from ...common.replies import DROPPED, Answer, error
from ..common.job import Job
from ..common.replica_choice import ReplicaChoice
from ..common.replicas_policy import Measurements, ReplicasPolicy
from ..common.tokens import TokenQueue
from ..layout.pieces import Piece
from .aggregator import GradientAggregator
from .read_ahead import push_answers
from .shards import Applied, Resized, Shard, ShardServer
from .token_line import TokenLine, unfillable
from .token_requests import TokenRequests

__all__ = ["SyncChief"]

log = logging.getLogger(__name__)


class SyncChief:
    """Shard 0's server + token line + chief sync op (module docstring), for ``job``
    (:class:`~..job.Job`: R, N, the token rule and initial tokens, ``timeout``, ``nonfinite``,
    ``last_step``, the moving averages, the starting ``global_step`` -- TF's ``chief_init_op``
    sets the accumulators to it, ``get_init_tokens_op`` fills the initial tokens with it -- and
    the ``policy`` that chooses each update's R).

    ``indices`` (default: every parameter) are the parameters of shard 0 held here;
    ``num_shards`` > 1 makes ``global_step`` wait for the other shards' ``applied`` reports;
    ``pieces`` (``shard_assignment="split"``): ``indices`` are of these pieces.
    """

    # no early answers for a replicated chief (what its copies leave out: ``__init__``)
    standby_early: tuple[str, ...] = ()

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        job: Job,
        indices: Sequence[int] | None = None,
        num_shards: int = 1,
        pieces: Sequence[Piece] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        count = sum(len(g["params"]) for g in opt.param_groups) if pieces is None else len(pieces)
        shard = Shard(opt, range(count) if indices is None else indices, job, pieces)
        self.server = ShardServer(0, shard, job, "chief", clock)
        self.job = job
        self.R, self.N = job.R, job.N
        self.global_step = int(job.global_step)
        shard.aggregator.set_global_step(self.global_step)
        self.line = TokenLine(
            job.tokens, self.global_step, job.initial_tokens, job.tokens_per_update
        )
        self.requests = TokenRequests()  # read-ahead's order of pushes and token requests
        self.choice = ReplicaChoice(job.R, job.policy)
        self.applied = [self.global_step] * num_shards  # each shard's step as last reported
        self.timeout, self.clock = job.timeout, clock
        self.ema = job.ema
        self.last_step = job.last_step
        self.left_at: dict[int, tuple[int, bool]] = {}  # worker -> (global step, reported dead)
        self.left_for: dict[int, str] = {}  # workers that left because a server was unreachable
        # (error class name, message) every request gets once the chief cannot go on
        self.broken: tuple[str, str] | None = None
        # replication (module docstring): where the standby is, told in hellos; each worker's
        # last step request number and the answer it was given; requests sent again
        self.standby: str | None = None
        self.standby_rank: int | None = None
        self.numbers: dict[int, int] = {}
        self.answered: dict[int, tuple[int | None, str, Any]] = {}
        self.resent: dict[int, int] = {}
        self.hello_to: dict[int, str] = {}  # the chief address each worker's hello went to
        self._ticked: list[dict[str, Any]] = []  # what ticks changed, for the standby
        # what a step's copy leaves out (module docstring): under the one-gradient-per-worker
        # rule the gradients stay here and the copy carries the verdict and the averages
        # (a worker whose gradient is pending still waits, so it sends the step again after
        # a loss); under TF's shared queue a worker may go on first: it sends them itself
        replicated = job.tokens == "distinct"
        self.standby_replaced = {"step": ("grads",)} if replicated else {}
        self.standby_direct = {} if replicated else {"step": ("grads",)}
        self.withdrawn: set[int] = set()  # (a standby that took over) steps to offer again
        # worker -> (shard, step number, where): a shard's standby withdrew that step's
        # gradient; the worker is told to send it again when its step request comes
        self.told_again: dict[int, tuple[int, int, str | None]] = {}
        if job.policy is not None:
            shard.measure()
        self._choose()

    # ------------------------------------------------------------------ its parts
    @property
    def shard(self) -> Shard:
        return self.server.shard

    @property
    def members(self) -> Membership:
        return self.server.members

    @property
    def params(self) -> list[torch.Tensor]:
        """The variables held here (shard 0: every variable when unsharded)."""
        return self.shard.params

    @property
    def aggregator(self) -> GradientAggregator:
        return self.shard.aggregator

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.shard.opt

    @property
    def tokens(self) -> TokenQueue:
        """The shared rule's queue of tokens (TF's ``sync_token_q``; empty for "distinct")."""
        return self.line.queue

    @property
    def policy(self) -> ReplicasPolicy | None:
        return self.choice.policy

    @property
    def measured(self) -> Measurements:
        return self.choice.measured

    @property
    def history(self) -> list[int]:
        """The R of every update made, in order."""
        return self.choice.history

    @property
    def replicas(self) -> dict[int, int]:
        """Step -> the R of its update (the pending one's and recent ones')."""
        return self.choice.replicas

    # ------------------------------------------------------------------ requests
    def handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer | Resized]:
        op = msg["op"]
        if op == "load_replica":  # a new standby starts from its primary's whole state
            self._load_replica(msg)
            return [Answer(ticket, {})]
        if msg["op"] == "read":  # changes nothing (a standby's own rank reads it, following)
            return self._own(self.server.handle(msg, ticket))
        if op == "where_standby":  # a restarted shard server asks (changes nothing)
            return [Answer(ticket, self._named())]
        # a standby's copy carries its primary's choices of R; a worker's request does not
        # (a primary, or a standby that took over: it chooses)
        given = msg.get("choice")
        self.choice.follow(given)
        self.shard.begin_request(self._keeping, msg.get("updates", ()))
        out = self._handle(msg, ticket)
        self.shard.check_given("chief", msg.get("op"))
        if given is not None:  # its policy's state and measurements, as the primary's
            self.choice.load_live(given)
        return out

    def _named(self) -> dict[str, Any]:
        """Where the standby is, for the workers and the shards (nothing without one)."""
        if self.standby is None:
            return {}
        return {"standby": self.standby, "standby_rank": self.standby_rank}

    @property
    def _keeping(self) -> bool:
        """Does this chief keep what each request decides, for its standby's copy?"""
        return self.standby is not None and bool(self.standby_replaced)

    def copy_fields(self) -> dict[str, Any]:
        """What the standby's copy of the request just handled carries besides it: the
        verdict and averages that replace its gradients (``Shard.decided``), and under a
        chosen R the choices and measurements they were made from (module docstring)."""
        out = self.shard.decided(self._keeping)
        if self.policy is not None:
            out["choice"] = self.choice.live_state()
        return out

    def take_over(self) -> None:
        """This standby takes its lost primary's place: the pending update's gradients it
        only counted (their sums stayed with the primary) are withdrawn, and each of their
        workers, which still waits for that update, offers its gradient again when it sends
        its step again (:meth:`_again`)."""
        pending = sorted(self.shard.contributors)
        if not self.standby_replaced or not pending:
            return
        self.aggregator.withdraw(pending)
        self.shard.contributors.clear()
        self.withdrawn = set(pending)
        log.warning("SyncReplicas chief (the standby, taking over): the gradients of worker "
                    "rank(s) %s for step %d are offered again as their steps come", pending,
                    self.global_step)  # fmt: skip

    def tick_requests(self) -> list[dict[str, Any]]:
        """The requests that make on the standby what the ticks since the last call changed
        here (an R lowered: ``lower``), in order; each call hands them out once."""
        out, self._ticked = self._ticked, []
        return out

    def _handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer | Resized]:
        op = msg["op"]
        if op == "lower":  # a copy: the primary's tick lowered the pending update's R
            before = self.global_step
            out = self._lowered(self.choice.lowered(int(msg["step"]), int(msg["r"])))
            return [*out, *(self._serve_tokens() if self.global_step != before else [])]
        if op == "applied":
            k = int(msg["shard"])
            if "noise" in msg:
                self.measured.noise(int(msg["step"]) - 1, *msg["noise"])
            self.applied[k] = max(self.applied[k], int(msg["step"]))
            self._advance()
            again = self._send_again(k, msg.get("withdrawn", ()), msg.get("at"))
            # where this chief's standby is now: the shard reports there once it is lost
            return [*again, *self._serve_tokens(), Answer(ticket, self._named())]
        worker = int(msg["worker"])
        if op == "done" and self._stale(worker, msg):
            return [Answer(ticket, {"global_step": self.global_step})]
        if op == "done":
            if msg.get("unreachable"):  # it left because a server is gone (its view)
                self.left_for[worker] = str(msg["unreachable"])
            forgotten = bool(msg.get("forgotten", False))
            if forgotten:  # dead for good: its place in line too (a copy's, whose ticket
                # was a standby's, is never answered)
                self.line.remove(lambda e: e.worker != worker)
                self.withdrawn.discard(worker)
            self.left_at[worker] = (self.global_step, forgotten)
            self.measured.forget(worker)
            self._forget_placeholder(worker)
            done = Answer(ticket, {"global_step": self.global_step})
            # "auto": the pending update waits for the live workers at most, on every shard;
            # shard 0's server lowers its own (and may make the update) as it handles "done"
            r = self.choice.fewer(self.global_step, self._live())
            told = [Resized(self.global_step, r)] if r is not None and len(self.applied) > 1 else []
            out = self._own(self.server.handle(msg, ticket))[1:]  # shard 0: its held push
            return [done, *told, *out, *self._serve_tokens()]
        if op in ("release", "read", "ema"):
            return self._own(self.server.handle(msg, ticket))
        if op == "members":
            self.members.heard(worker)
            return [Answer(ticket, self.members.report())]
        if op == "stats":
            (answer,) = self.server.handle(msg, ticket)
            extra = {"global_step": self.global_step, "replicas": list(self.history)}
            return [replace(answer, payload={**answer.payload, **extra})]  # type: ignore[arg-type]
        if self.broken is not None:
            self.members.heard(worker)
            return [error(ticket, *self.broken)]
        if "grads" in msg or "withheld" in msg:  # a push: this worker's round (withheld: untimed)
            self.measured.arrived(worker, int(msg["tag"]), self.clock(), "grads" in msg)
        if op == "hello":
            return self._hello(worker, msg, ticket)
        if op == "push":  # sharded jobs: push first (concurrently with the shards), then "step"
            return self._push(worker, msg, ticket)
        if op == "step":
            return self._token_request(worker, msg, ticket)
        raise ValueError(f"unknown request {op!r}")

    def _stale(self, worker: int, msg: dict[str, Any]) -> bool:
        """A report that ``worker`` went with a lost chief's host (``lost_server``: that
        chief's address) about a worker whose latest hello went to another chief: a restarted
        worker that joined since, not the lost one, whose steps must keep their place."""
        lost, said = msg.get("lost_server"), self.hello_to.get(worker)
        if not msg.get("forgotten") or lost is None or said is None or said == lost:
            return False
        log.info("SyncReplicas chief: worker rank %d said hello to %s since the chief at %s "
                 "was lost: the report of its loss is about its earlier self", worker, said,
                 lost)  # fmt: skip
        return True

    def _hello(self, worker: int, msg: dict[str, Any], ticket: Any) -> list[Answer | Resized]:
        if msg.get("to") is not None:  # the chief it joined: a loss reported later is older
            self.hello_to[worker] = str(msg["to"])
        (answer,) = self._own(self.server.handle(msg, ticket))
        self.left_at.pop(worker, None)
        self.left_for.pop(worker, None)
        self.numbers.pop(worker, None)  # a restarted worker's numbers start again
        self.answered.pop(worker, None)
        self.measured.served(worker, self.global_step, self.clock())
        extra = {"global_step": self.global_step, "r": self.replicas[self.global_step]}
        # whether the worker sends its gradients to a standby too (now or once one attaches)
        extra["standby_data"] = bool(self.standby_direct)
        extra.update(self._named())
        return [replace(answer, payload={**answer.payload, **extra})]

    def _push(self, worker: int, msg: dict[str, Any], ticket: Any) -> list[Answer | Resized]:
        self.members.heard(worker)
        was_parked = self.requests.parked(worker)
        accepted, updated = self.server.offer(msg)
        if updated:
            self._shard0_updated()
        answers = push_answers(self.shard, self.server.held, msg, ticket, accepted, updated)
        request = self.requests.pushed(worker, msg)
        if msg.get("token_follows") and not was_parked:  # a placeholder (:mod:`.token_requests`)
            self._wait_for_token({"worker": worker, "tag": msg["tag"], "values": False}, None, True)
        if request is not None:  # the token request that overtook this push goes on
            self._wait_for_token(*request, True)
        return [*answers, *self._serve_tokens()]

    def _token_request(
        self, worker: int, msg: dict[str, Any], ticket: Any
    ) -> list[Answer | Resized]:
        self.members.heard(worker)
        self._alive(worker)
        number = msg.get("number")
        if number is not None:
            if self.numbers.get(worker) == int(number):
                return self._again(worker, msg, ticket)
            self.numbers[worker] = int(number)
            told = self.told_again.get(worker)
            if told is not None and told[1] != int(number):
                del self.told_again[worker]  # (an older step's: that gradient is not coming)
        if not self.requests.ready(msg):
            self.requests.park(msg, ticket)  # its push to shard 0 is still on its way
            return []
        accepted = True
        if {"grads", "withheld", "verdict"} & msg.keys():  # one server: the push travels with it
            # (a standby's copy: the verdict, the gradients stayed with its primary)
            accepted, updated = self.server.offer(msg)
            if updated:
                self._shard0_updated()
        else:
            placed = self._claim_place(worker, ticket)
            if placed is not None:
                return placed
        self._wait_for_token(msg, ticket, accepted)
        if worker in self.told_again:  # a shard's standby withdrew this step's gradient
            k, number, address = self.told_again.pop(worker)
            return [*self._send_again(k, [(worker, number)], address), *self._serve_tokens()]
        return self._serve_tokens()

    def _send_again(self, k: int, withdrawn: Any, address: str | None) -> list[Answer]:
        """Shard ``k``'s standby took over (at ``address``) and withdrew the gradients of the
        ``withdrawn`` ``(worker, step number)`` pushes (their sums went with its primary): each
        such worker that waits in line for that step's token is told to send the step again
        (``send_again``: it moves shard ``k`` there), keeping its place; one whose step request
        has not come yet is told when it does (``told_again``)."""
        out = []
        for worker, number in withdrawn:
            worker, number = int(worker), int(number)
            if self.numbers.get(worker) != number:
                if self.numbers.get(worker, -1) < number:  # (not an older step of it)
                    self.told_again[worker] = (k, number, address)
                continue
            for entry in self.line:
                if entry.worker == worker and entry.ticket is not None:
                    out.append(Answer(entry.ticket, {"send_again": k, "at": address}))
                    entry.ticket = None  # its step, sent again, waits here (_again)
                    break
        return out

    def _alive(self, worker: int) -> None:
        """A worker reported dead for good that still sends steps is alive: the report was
        about its earlier self (a worker that moved to a standby late reports the lost
        chief's worker after its restarted process said hello here)."""
        if self.left_at.get(worker, (0, False))[1]:
            del self.left_at[worker]
            self.members.hello(worker)

    def _again(self, worker: int, msg: dict[str, Any], ticket: Any) -> list[Answer | Resized]:
        """Worker ``worker``'s step request sent again under the same number (it moved here
        from a lost primary): its place in line now waits with this ticket, or it gets the
        answer it was given, with the values as they are now.  Nothing is applied again."""
        self.resent[worker] = self.resent.get(worker, 0) + 1
        version = int(msg["version"]) if msg.get("values", True) else None
        for entry in self.line:
            if entry.worker == worker:
                entry.ticket, entry.version = ticket, version
                if worker not in self.withdrawn:
                    return []
                self.withdrawn.discard(worker)  # its gradient, withdrawn at the takeover
                entry.accepted, updated = self.server.offer(msg)
                if updated:
                    self._shard0_updated()
                return self._serve_tokens()
        # told to send it again (``send_again``), its place was served meanwhile: the answer
        # kept for it
        granted = self.requests.claim(worker)
        if granted is not None:
            return self._answer(worker, ticket, *granted)
        number, kind, payload = self.answered.get(worker, (None, "", None))
        if number != int(msg["number"]):
            raise RuntimeError(
                f"SyncReplicas chief: worker rank {worker} sent step request {msg['number']} "
                "again, but it neither waits in the token line nor was answered"
            )
        if kind != "token":
            return [error(ticket, kind, payload)]
        answer = {**payload, "version": self.shard.step}
        if version is not None and version != self.shard.step:
            answer["params"] = self.params
        return [Answer(ticket, answer, self.shard.values_key if "params" in answer else None)]

    def _own(self, outs: list[Answer | Applied]) -> list[Answer]:
        """Shard 0's outputs: its own update reported here, the answers passed on."""
        answers = []
        for out in outs:
            if isinstance(out, Applied):
                self._shard0_updated()
            else:
                answers.append(out)
        return answers

    def _wait_for_token(self, msg: dict[str, Any], ticket: Any, accepted: bool) -> None:
        version = int(msg["version"]) if msg.get("values", True) else None
        self.line.join(int(msg["worker"]), ticket, int(msg["tag"]), accepted, version)

    def _claim_place(self, worker: int, ticket: Any) -> list[Answer] | None:
        """A token request of a worker with a place in line: what that place was given, or
        nothing yet (the place now waits with this request's ticket); None: no place."""
        granted = self.requests.claim(worker)
        if granted is not None:
            return self._answer(worker, ticket, *granted)
        for entry in self.line:
            if entry.worker == worker and entry.ticket is None:
                entry.ticket = ticket
                return []
        return None

    def _forget_placeholder(self, worker: int) -> None:
        """``worker`` left: its place in line goes, and a token it never asked for goes back."""
        self.line.remove(lambda e: e.worker != worker or e.ticket is not None)
        kind, payload = self.requests.claim(worker) or ("", None)
        if kind == "token":
            self.line.give_back(int(payload["token"]))

    def _answer(self, worker: int, ticket: Any, kind: str, payload: Any) -> list[Answer]:
        """Answer a worker in line, or keep the answer for a place whose request is still on
        its way (ticket None)."""
        if ticket is None:
            self.requests.grant(worker, kind, payload)
            return []
        kept = {k: v for k, v in payload.items() if k != "params"} if kind == "token" else payload
        self.answered[worker] = (self.numbers.get(worker), kind, kept)
        if kind == "token":
            key = self.shard.values_key if "params" in payload else None
            return [Answer(ticket, payload, key)]
        return [error(ticket, kind, payload)]

    # ------------------------------------------------------------------ updates
    @property
    def contributors(self) -> set[int]:
        """Workers whose gradient is in shard 0's pending update."""
        return self.shard.contributors

    def _shard0_updated(self) -> None:
        self.applied[0] = self.shard.step
        noise = self.aggregator.last_noise
        if self.policy is not None and noise is not None:
            self.measured.noise(self.shard.step - 1, *noise)
        self._advance()

    def _advance(self) -> None:
        """``global_step += 1`` once every shard applied the update, then the next update's R
        and the tokens."""
        while min(self.applied) > self.global_step:
            self.choice.made(self.global_step, self.clock(), live=self._live())
            self.global_step += 1
            self._choose()
            self.line.updated(self.global_step)

    def _live(self) -> list[int]:
        return [w for w in range(self.N) if w not in self.left_at]

    def _choose(self) -> None:
        """The R of the update at ``global_step`` (shard 0 may be an update ahead already:
        its R is then set when ``global_step`` catches up)."""
        r = self.choice.decide(self.global_step, self._live(), self.clock())
        if self.shard.step == self.global_step:
            self.aggregator.set_replicas(r)

    def _lowered(self, r: int) -> list[Answer | Resized]:
        """The pending update's R is ``r`` now: the other shards are told, and shard 0 makes
        it at once if the gradients are in."""
        out: list[Answer | Resized] = []
        if len(self.applied) > 1:
            out.append(Resized(self.global_step, r))  # the other shards: before this one moves on
        return [*out, *self._own(self.server.resize(self.global_step, r))]

    def _serve_tokens(self) -> list[Answer]:
        """Serve every worker in line that can go on (:mod:`.token_line`); if the live workers
        can never make the pending update, fail the others at once, naming why."""
        released = self.last_step is not None and self.global_step >= self.last_step
        out = []
        now = self.clock()
        for entry, token in self.line.serve(self.global_step, released):
            self.measured.served(entry.worker, token, now)
            answer = {
                "token": token,
                "accepted": entry.accepted,
                "global_step": self.global_step,
                "version": self.shard.step,
                "r": self.choice.of(token, self.global_step),
            }
            answer.update(self._named())  # a worker follows a standby that attached since
            if entry.version is not None and entry.version != self.shard.step:
                answer["params"] = self.params
            out += self._answer(entry.worker, entry.ticket, "token", answer)
        if len(self.line) and not released:
            why = unfillable(
                rule=self.line.rule,
                replicas_to_aggregate=self.replicas[self.global_step],
                total_num_replicas=self.N,
                gradients_in=self.aggregator.counter,
                contributors=self.contributors,
                left=self.left_at,
                waiting={e.worker for e in self.line},
                tokens_left=len(self.line.queue),
                others_pending=self.requests.any_parked or self.global_step < self.shard.step,
                global_step=self.global_step,
            )
            if why is not None and self.left_for:  # (each of them is in left_at too)
                # a worker left because it lost a server: the waiting ones hear that server's
                # loss (this chief's probe, or their own link), not that the worker left
                log.debug("%s; not said: a worker left for %s", why, list(self.left_for.values()))
            elif why is not None:
                log.error("%s", why)
                for entry in self.line.take_all():
                    out += self._answer(entry.worker, entry.ticket, "RuntimeError", why)
        return out

    # ------------------------------------------------------------------ liveness
    def unreachable(self, message: str) -> list[Answer]:
        """A shard server is gone: every waiting and later request fails with
        ``ServerUnreachable(message)``."""
        return self.fail("ServerUnreachable", message)

    def fail(self, kind: str, message: str, cause: BaseException | None = None) -> list[Answer]:
        """The chief cannot go on: every waiting and later request fails with the error
        ``kind`` (a class name, e.g. ``"ServerUnreachable"``, or a bug's own) and ``message``.
        The first cause is kept and logged once, at ERROR (with ``cause``'s traceback if
        given); later calls only answer the waiting requests with it."""
        if self.broken is None:
            log.error("%s", message, exc_info=cause)
            self.broken = (kind, message)
        return self.tick()

    def tick(self, now: float | None = None) -> list[Answer | Resized]:
        """Fail the requests that waited too long (or all, once a shard is unreachable)."""
        now = self.clock() if now is None else now
        out = []
        if self.broken is not None:
            for entry in self.line.take_all():
                out += self._answer(entry.worker, entry.ticket, *self.broken)
            # a token request that overtook its push waits outside the line: it fails too
            for request, ticket in self.requests.take_parked():
                out += self._answer(int(request["worker"]), ticket, *self.broken)
        while len(self.line) and now - self.line.waiting[0].since > self.timeout:
            first = self.line.waiting[0]
            message = self.stall_message(first.worker, now - first.since)  # still waiting
            log.error("%s", message)
            self.line.waiting.popleft()
            out += self._answer(first.worker, first.ticket, "TimeoutError", message)
        if self.broken is None:  # "auto": a worker far behind may lower the pending R
            r = self.choice.reconsider(self.global_step, self._live(), now)
            if r is not None:
                before = self.global_step
                self.shard.begin_request(self._keeping)
                out += self._lowered(r)
                if self.standby is not None:  # the standby lowers it too, in this order
                    lower = {"op": "lower", "worker": -1, "step": before, "r": r}
                    self._ticked.append({**lower, **self.shard.decided(self._keeping)})
                out += self._serve_tokens() if self.global_step != before else []
        return out

    def silent_workers(self, now: float | None = None) -> list[int]:
        """Workers silent for over ``timeout`` s (those waiting for a token are blocked, not
        silent)."""
        return self.members.silent(now, busy=[e.worker for e in self.line])

    def stall_message(self, worker: int, waited: float) -> str:
        silent = self.silent_workers()
        who = (
            f"no message from worker rank(s) {silent} for over {self.timeout:g}s (dead or stuck)"
            if silent
            else "every live worker is waiting too"
            + (" (not enough tokens: check num_tokens)" if self.line.rule == "shared" else "")
        )
        shards = f"; shard steps {self.applied}" if len(self.applied) > 1 else ""
        r = self.replicas.get(self.global_step, self.R)
        return (
            f"SyncReplicasOptimizer: worker rank {worker} waited {waited:.1f}s for a token at "
            f"global step {self.global_step} ({self.aggregator.counter} of {r} fresh "
            f"gradients in{shards}); {who}; progress needs replicas_to_aggregate={r}"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = {
            "global_step": self.global_step,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "tokens": self.line.state(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "replicas": self.choice.state_dict(),
        }
        if len(self.applied) > 1:
            state["applied"] = list(self.applied)
        return state

    def replica_state(self) -> dict[str, Any]:
        """Everything a new standby starts from (its ``load_replica``): the checkpoint's state,
        the workers waiting in line and who left, each worker's last step request and its
        answer."""
        return {
            "chief": self.state_dict(),
            "waiting": [(e.worker, e.tag, e.accepted, e.version) for e in self.line],
            "contributors": sorted(self.shard.contributors),
            "left_at": dict(self.left_at),
            "left_for": dict(self.left_for),
            "numbers": dict(self.numbers),
            "answered": dict(self.answered),
            "resent": dict(self.resent),
            "hello_to": dict(self.hello_to),
            "members": (sorted(self.members.left), sorted(self.members.forgotten)),
            "withdrawn": sorted(self.withdrawn),
        }

    def _load_replica(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["chief"])
        self.line.take_all()
        for worker, tag, accepted, version in state["waiting"]:  # a copy's: never answered
            self.line.join(worker, DROPPED, tag, accepted, version)
        self.shard.contributors = set(state["contributors"])
        self.left_at, self.left_for = dict(state["left_at"]), dict(state["left_for"])
        self.numbers, self.answered = dict(state["numbers"]), dict(state["answered"])
        self.resent = dict(state["resent"])
        self.hello_to = dict(state.get("hello_to", {}))
        self.withdrawn = set(state.get("withdrawn", ()))
        left, forgotten = state["members"]
        self.members.left, self.members.forgotten = set(left), set(forgotten)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        applied = list(state.get("applied", [state["global_step"]]))
        if len(applied) != len(self.applied):
            raise ValueError(
                f"SyncReplicasOptimizer: checkpoint has {len(applied)} shard(s), this chief "
                f"{len(self.applied)} (use the same server_ranks)"
            )
        self.shard.load_state_dict(
            {
                "indices": self.shard.indices,
                "params": state["params"],
                "optimizer": state["optimizer"],
                "aggregator": state["aggregator"],
                "shadows": [],
            }
        )
        self.global_step = int(state["global_step"])
        self.applied = [int(a) for a in applied]
        self.line.load(state["tokens"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        self.choice.load_state_dict(state.get("replicas"))
        if self.global_step not in self.replicas:
            self._choose()
        elif self.shard.step in self.replicas:
            self.aggregator.set_replicas(self.replicas[self.shard.step])
