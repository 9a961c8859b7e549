"""The SyncReplicas chief: TF's parameter server of shard 0 plus the chief's sync op.

:class:`SyncChief` owns the variables of shard 0 (every variable when unsharded), a copy of the
wrapped optimizer, their :class:`~.aggregator.GradientAggregator`, the
:class:`~.aggregator.TokenQueue` and ``global_step``.  It is a state machine: ``handle(request,
ticket)`` and ``tick()`` return :class:`~gradfleet.distributed.replies.Answer` objects, one
request at a time (the hosting server never overlaps two calls), so it needs no lock and does
no I/O:

* ``hello``:  check the worker's parameter shapes/dtypes; answer variables + step
  (TF's ``local_step_init_op``: ``local_step := global_step``).
* ``push``:   (sharded jobs) only the push below, answered with ``accepted``; with ``ahead``
  (read-ahead, :mod:`.read_ahead`) held until shard 0 applied the update it could join, then
  answered with shard 0's values; with ``token_follows`` its worker takes its place in the
  token line at once (its token request comes next and gets what that place was given).
* ``release``: the worker has its token: answer its held push now.
* ``read``:   shard 0's values unless the worker holds that version (read-ahead: a worker whose
  answer was older than its token reads again).
* ``step``:   push the gradients (if given) with the worker's tag; if ``R`` are in, take the
  averages, apply them with the wrapped optimizer, ``global_step += 1`` after all variables,
  update the moving averages; then answer with a token once the token line's rule allows
  (:mod:`.token_line`: one gradient per worker per update, or TF's shared queue of
  ``max(N, R)`` tokens per update) and the current variables (not with ``values=False``: a
  token request that travels apart from the push, whose answer brings the values).  When the
  live workers can never make the pending update, every worker in line gets the reason.
* ``applied``: a shard server finished an update (sharded jobs).
* ``done``:   the worker left (``forgotten``: another rank reports it dead for good).
* ``tick``:   a worker that waited ``timeout`` seconds for a token gets a ``TimeoutError``
  naming the ranks it is waiting for (silent ones), never a silent hang.

With parameter shards the chief holds shard 0 only, learns the other shards' updates from their
``applied`` reports and sets ``global_step`` to the minimum shard step (tokens after every
increment).  The hosting code watches the shard servers; :meth:`SyncChief.unreachable` then
answers every waiting and later request with ``ServerUnreachable`` naming the dead one.

``last_step`` (beyond TF): once ``global_step`` reaches it every token request is answered at
once, so no worker blocks at the end of training (TF's end-of-training hangs, #7970).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..membership import Membership
from ..moving_average import ExponentialMovingAverage
from ..replies import Answer, error
from .aggregator import GradientAggregator, TokenQueue
from .pieces import Piece
from .read_ahead import HeldPushes, push_answers, read_answer, release_answers, values_answer
from .replicas_policy import Decision, Measurements, ReplicasPolicy
from .shards import Resized, Shard, pushed_gradients
from .token_line import TokenLine, unfillable

__all__ = ["SyncChief"]

log = logging.getLogger(__name__)


class SyncChief:
    """TF's PS variables + accumulators + token queue + chief sync op (module docstring).

    ``indices`` (default: every parameter) are the parameters of shard 0 held here;
    ``num_shards`` > 1 makes ``global_step`` wait for the other shards' ``applied`` reports;
    ``pieces`` (``shard_assignment="split"``): ``indices`` are of these pieces.
    ``global_step``: the step to start from (a restored one: TF's ``chief_init_op`` sets the
    accumulators to it, ``get_init_tokens_op`` fills the initial tokens with it).
    ``tokens``: the token line's rule, ``"shared"`` (TF's queue, this machine's default) or
    ``"distinct"`` (:mod:`.token_line`).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        replicas_to_aggregate: int,
        total_num_replicas: int,
        num_tokens: int,
        timeout: float,
        variable_averages: ExponentialMovingAverage | None = None,
        average_indices: Sequence[int] = (),
        nonfinite: str = "raise",
        last_step: int | None = None,
        indices: Sequence[int] | None = None,
        num_shards: int = 1,
        pieces: Sequence[Piece] | None = None,
        global_step: int = 0,
        tokens: str = "shared",
        policy: ReplicasPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        count = sum(len(g["params"]) for g in opt.param_groups) if pieces is None else len(pieces)
        self.shard = Shard(
            opt,
            range(count) if indices is None else indices,
            replicas_to_aggregate,
            nonfinite,
            variable_averages,
            average_indices,
            last_step,
            pieces,
        )
        self.R, self.N = replicas_to_aggregate, total_num_replicas
        self.global_step = int(global_step)
        self.shard.aggregator.set_global_step(self.global_step)
        per_update = max(total_num_replicas, replicas_to_aggregate)
        self.line = TokenLine(tokens, self.global_step, num_tokens, per_update)
        self.applied = [self.global_step] * num_shards  # each shard's step as last reported
        self.timeout = timeout
        self.ema = variable_averages
        self.last_step = last_step
        self.members = Membership(total_num_replicas, timeout, "SyncReplicas chief", clock)
        self.left_at: dict[int, tuple[int, bool]] = {}  # worker -> (global step, reported dead)
        self.contributors: set[int] = set()  # workers whose gradient is in shard 0's pending update
        self.broken: str | None = None
        self.held = HeldPushes()  # read-ahead pushes to shard 0
        # read-ahead: a token request names the worker's push to shard 0 (``after``) and is
        # served only once that push is in, as TF dequeues a token after its push
        self.last_push: dict[int, tuple[str, int]] = {}
        self.early: dict[int, tuple[dict[str, Any], Any]] = {}  # worker -> token request
        # a push to shard 0 that a token request follows (``token_follows``) puts its worker
        # in the token line at once (a placeholder: ticket None), as if the request came with
        # it: else the update that push completes could hand a faster worker's next request
        # the token meant for this one, which TF allows but breaks R = N lockstep.  A token
        # (or an error) served to a placeholder waits here for the request.
        self.granted: dict[int, tuple[str, Any]] = {}
        # each update's R: fixed, or chosen before it by ``policy`` (``"auto"``) from what
        # ``measured`` records (:mod:`.replicas_policy`)
        self.policy, self.clock = policy, clock
        self.measured = Measurements()
        self.history: list[int] = []  # the R of every update made, in order
        self.replicas: dict[int, int] = {self.global_step: self.R}  # step -> its update's R
        if policy is not None:
            self.shard.measure()
            self._choose()

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

    # ------------------------------------------------------------------ requests
    def handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer]:
        op = msg["op"]
        if op == "applied":
            k = int(msg["shard"])
            if "noise" in msg:
                self.measured.noise(int(msg["step"]) - 1, *msg["noise"])
            self.applied[k] = max(self.applied[k], int(msg["step"]))
            self._advance()
            return [*self._serve_tokens(), Answer(ticket, {})]
        worker = int(msg["worker"])
        if op == "done":
            forgotten = bool(msg.get("forgotten", False))
            self.members.leave(worker, forgotten=forgotten)
            self.left_at[worker] = (self.global_step, forgotten)
            self.measured.forget(worker)
            left = self.held.drop(worker)
            self._forget_placeholder(worker)
            done = [Answer(ticket, {"global_step": self.global_step})]
            held = [] if left is None else [values_answer(self.shard, left)]
            return [*done, *held, *self._fewer_live(), *self._serve_tokens()]
        if op == "release":
            return release_answers(self.shard, self.held, msg)
        self.members.heard(worker)
        if self.broken is not None and op in ("hello", "push", "step"):
            return [error(ticket, "ServerUnreachable", self.broken)]
        if op == "hello":
            self.shard.check_layout(worker, msg["shapes"], msg["dtypes"], "chief")
            self.members.hello(worker)
            self.left_at.pop(worker, None)
            self.measured.served(worker, self.global_step, self.clock())
            values = {
                "global_step": self.global_step,
                "params": self.params,
                "r": self.replicas[self.global_step],
            }
            return [Answer(ticket, dict(values, version=self.shard.step), self.shard.values_key)]
        if op in ("push", "step"):
            self.shard.follow(msg.get("hyper"))
            if "grads" in msg or "withheld" in msg:  # its round (withheld: not timed)
                self.measured.arrived(worker, int(msg["tag"]), self.clock(), "grads" in msg)
        if op == "push":  # sharded jobs: push first (concurrently with the shards), then "step"
            before = self.shard.step
            accepted = self.push(worker, int(msg["tag"]), pushed_gradients(msg))
            updated = self.shard.step != before
            answers = push_answers(self.shard, self.held, msg, ticket, accepted, updated)
            self.last_push[worker] = (str(msg.get("inc", "")), int(msg.get("seq", -1)))
            if msg.get("token_follows") and worker not in self.early:
                place = {"worker": worker, "tag": msg["tag"], "values": False}
                self._wait_for_token(place, None, True)
            if worker in self.early and self._pushed_before(self.early[worker][0]):
                self._wait_for_token(*self.early.pop(worker), True)
            return [*answers, *self._serve_tokens()]
        if op == "step" and not self._pushed_before(msg):
            self.early[worker] = (msg, ticket)  # its push to shard 0 is still on its way
            return []
        pushes = "grads" in msg or "withheld" in msg  # a "step" that carries its push
        if op == "step" and not pushes:
            placed = self._claim_place(worker, ticket)
            if placed is not None:
                return placed
        if op == "step":
            accepted = self.push(worker, int(msg["tag"]), pushed_gradients(msg)) if pushes else True
            self._wait_for_token(msg, ticket, accepted)
            return self._serve_tokens()
        if op == "read":  # read-ahead: shard 0 read again after a later token
            return [read_answer(self.shard, ticket, int(msg["version"]))]
        if op == "stats":
            stats = {"global_step": self.global_step, "stats": self.aggregator.stats}
            return [Answer(ticket, dict(stats, replicas=list(self.history)))]
        if op == "ema":
            return [Answer(ticket, {"shadows": self.shard.shadows()})]
        if op == "members":
            return [Answer(ticket, self.members.report())]
        raise ValueError(f"unknown request {op!r}")

    def _pushed_before(self, msg: dict[str, Any]) -> bool:
        """A token request naming a push (``after_inc``, ``after_seq``) waits for it."""
        if "after_seq" not in msg:
            return True
        named = (str(msg["after_inc"]), int(msg["after_seq"]))
        return self.last_push.get(int(msg["worker"])) == named

    def _wait_for_token(self, msg: dict[str, Any], ticket: Any, accepted: bool) -> None:
        version = int(msg["version"]) if msg.get("values", True) else None
        self.line.join(int(msg["worker"]), ticket, int(msg["tag"]), accepted, version)

    def _claim_place(self, worker: int, ticket: Any) -> list[Answer] | None:
        """A token request of a worker with a place in line: what that place was given, or
        nothing yet (the place now waits with this request's ticket); None: no place."""
        if worker in self.granted:
            return self._answer(worker, ticket, *self.granted.pop(worker))
        for entry in self.line:
            if entry.worker == worker and entry.ticket is None:
                entry.ticket = ticket
                return []
        return None

    def _forget_placeholder(self, worker: int) -> None:
        """``worker`` left: its place in line goes, and a token it never asked for goes back."""
        self.line.remove(lambda e: e.worker != worker or e.ticket is not None)
        kind, payload = self.granted.pop(worker, ("", None))
        if kind == "token":
            self.line.give_back(int(payload["token"]))

    def _answer(self, worker: int, ticket: Any, kind: str, payload: Any) -> list[Answer]:
        """Answer a worker in line, or keep the answer for a place whose request is still on
        its way (ticket None)."""
        if ticket is None:
            self.granted[worker] = (kind, payload)
            return []
        if kind == "token":
            key = self.shard.values_key if "params" in payload else None
            return [Answer(ticket, payload, key)]
        return [error(ticket, kind, payload)]

    def push(self, worker: int, tag: int, grads: list[torch.Tensor | None] | None) -> bool:
        """Offer shard 0's gradients (None: withheld as stale); update when ``R`` are in.
        True iff accepted."""
        accepted, updated = self.shard.push(worker, tag, grads)
        if updated:
            self._shard0_updated()
        elif accepted:
            self.contributors.add(worker)
        return accepted

    def _shard0_updated(self) -> None:
        self.contributors.clear()
        self.applied[0] = self.shard.step
        noise = self.shard.aggregator.last_noise
        if self.policy is not None and noise is not None:
            self.measured.noise(self.shard.step - 1, *noise)
        self._advance()

    def _advance(self) -> None:
        """``global_step += 1`` once every shard applied the update, then the next update's R
        and the tokens."""
        while min(self.applied) > self.global_step:
            update = self.global_step
            self.history.append(self.replicas.get(update, self.R))
            self.measured.close_update(update)
            self.global_step += 1
            self._choose()
            self.line.updated(self.global_step)

    def _live(self) -> list[int]:
        return [w for w in range(self.N) if w not in self.left_at]

    def _choose(self) -> None:
        """The R of the update at ``global_step``: fixed, or the policy's choice (logged)."""
        step = self.global_step
        if self.policy is None:
            r = self.R
        else:
            view = self._decision(self.clock())
            r = self.policy.choose(view)
            if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= view.live:
                raise ValueError(
                    f"SyncReplicasOptimizer: the replicas policy {self.policy!r} chose {r!r} "
                    f"for the update at global step {step}; it must be an int in "
                    f"[1, {view.live}] (the live workers)"
                )
            log.debug(
                "SyncReplicas chief: update %d waits for R=%d of %d live workers (noise scale "
                "%s, rounds %s s)", step, r, view.live, view.noise_scale,
                None if view.rounds is None else [round(a, 3) for a in view.rounds],
            )  # fmt: skip
        self.replicas[step] = r
        for old in [s for s in self.replicas if s < step - 64]:  # tokens that old are stale
            del self.replicas[old]
        if self.shard.step == step:  # (shard 0 may be an update ahead: its R comes later)
            self.shard.aggregator.set_replicas(r)

    def _decision(self, now: float) -> Decision:
        """What the policy sees of the update at ``global_step``."""
        live = self._live()
        step = self.global_step
        return Decision(
            update=step,
            live=max(len(live), 1),
            rounds=self.measured.expected_rounds(now, live),
            noise_scale=self.measured.noise_scale(),
            previous=self.replicas.get(step - 1, self.R),
        )

    def _fewer_live(self) -> list[Answer | Resized]:
        """A worker left (``"auto"``): the pending update waits for the live workers at most."""
        live = max(len(self._live()), 1)
        if self.policy is None or self.replicas.get(self.global_step, 0) <= live:
            return []
        return self._lower(live, "a worker left")

    def _reconsider(self, now: float) -> list[Answer | Resized]:
        """``"auto"``, while the pending update waits: a live worker whose gradient is not in
        has taken over twice its usual round (dead, or slowed down since the choice): choose
        again with what is known now, and lower R if the policy would.  Never raises R: the
        workers' pushes to other shards carry the R they were told."""
        step = self.global_step
        if self.policy is None or self.broken is not None or step not in self.replicas:
            return []
        if not self.measured.overdue(now, self._live()):
            return []
        view = self._decision(now)
        r = self.policy.choose(view)
        if not isinstance(r, int) or not 1 <= r < self.replicas[step]:
            return []
        return self._lower(r, f"worker(s) {self.measured.overdue(now, self._live())} overdue")

    def _lower(self, r: int, why: str) -> list[Answer | Resized]:
        """The pending update waits for ``r`` gradients now; made at once if they are in."""
        step = self.global_step
        log.debug("SyncReplicas chief: update %d now waits for R=%d (%s)", step, r, why)
        self.replicas[step] = r
        out: list[Answer | Resized] = []
        if len(self.applied) > 1:
            out.append(Resized(step, r))  # the other shards: before this one moves on
        if self.shard.step == step and self.shard.set_replicas(r):
            due = self.held.due(self.shard.step)  # read-ahead pushes that waited for it
            self._shard0_updated()
            out += [values_answer(self.shard, h) for h in due]
        return out

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
                "r": self.replicas.get(token, self.replicas[self.global_step]),
            }
            if entry.version is not None and entry.version != self.shard.step:
                answer["params"] = self.params
            out += self._answer(entry.worker, entry.ticket, "token", answer)
        if len(self.line) and not released:
            why = unfillable(
                rule=self.line.rule,
                replicas_to_aggregate=self.R,
                total_num_replicas=self.N,
                gradients_in=self.aggregator.counter,
                contributors=self.contributors,
                left=self.left_at,
                waiting={e.worker for e in self.line},
                tokens_left=len(self.line.queue),
                others_pending=bool(self.early) or self.global_step < self.shard.step,
                global_step=self.global_step,
            )
            if why is not None:
                log.error("%s", why)
                for entry in self.line.take_all():
                    out += self._answer(entry.worker, entry.ticket, "RuntimeError", why)
        return out

    # ------------------------------------------------------------------ liveness
    def unreachable(self, message: str) -> list[Answer]:
        """A shard server is gone: every waiting and later request fails with ``message``."""
        if self.broken is None:
            log.error("%s", message)
        self.broken = message
        return self.tick()

    def tick(self, now: float | None = None) -> list[Answer | Resized]:
        """Fail the requests that waited too long (or all, once a shard is unreachable)."""
        now = self.clock() if now is None else now
        out = []
        if self.broken is not None:
            for entry in self.line.take_all():
                out += self._answer(entry.worker, entry.ticket, "ServerUnreachable", self.broken)
        while len(self.line) and now - self.line.waiting[0].since > self.timeout:
            first = self.line.waiting[0]
            message = self.stall_message(first.worker, now - first.since)  # still waiting
            log.error("%s", message)
            self.line.waiting.popleft()
            out += self._answer(first.worker, first.ticket, "TimeoutError", message)
        before = self.global_step
        out += self._reconsider(now)
        return out + (self._serve_tokens() if self.global_step != before else [])

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
        return (
            f"SyncReplicasOptimizer: worker rank {worker} waited {waited:.1f}s for a token at "
            f"global step {self.global_step} ({self.aggregator.counter} of {self.R} fresh "
            f"gradients in{shards}); {who}; progress needs replicas_to_aggregate={self.R}"
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
            "replicas": {
                "history": list(self.history),
                "pending": {int(k): int(v) for k, v in self.replicas.items()},
                "policy": None if self.policy is None else self.policy.state_dict(),
                "measured": None if self.policy is None else self.measured.state_dict(),
            },
        }
        if len(self.applied) > 1:
            state["applied"] = list(self.applied)
        return state

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
        self._load_replicas(state.get("replicas"))

    def _load_replicas(self, saved: dict[str, Any] | None) -> None:
        """Each update's R as saved: the history, the pending update's R and the policy's
        state, so a resumed job goes on choosing as it would have."""
        if saved is None:  # a checkpoint from before R was recorded
            self.history, self.replicas = [], {}
        else:
            self.history = [int(r) for r in saved["history"]]
            self.replicas = {int(k): int(v) for k, v in saved["pending"].items()}
            if self.policy is not None and saved["policy"] is not None:
                self.policy.load_state_dict(saved["policy"])
                self.measured.load_state_dict(saved["measured"])
        if self.global_step not in self.replicas:
            self._choose()
        elif self.shard.step in self.replicas:
            self.shard.aggregator.set_replicas(self.replicas[self.shard.step])
