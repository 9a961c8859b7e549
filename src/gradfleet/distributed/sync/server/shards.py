"""Parameter shards of ``SyncReplicasOptimizer``: TF's variables spread over several ps tasks.

``server_ranks=[r0, r1, ...]`` (S shards): shard ``k`` is hosted by rank ``server_ranks[k]``
(a rank may host several shards); which variables each holds is the layout's decision
(:mod:`..layout.assignment`).  A :class:`Shard` holds its variables,
their accumulators (one :class:`GradientAggregator`: TF's per-accumulator staleness rule and
accepted counts, per shard) and a copy of the wrapped optimizer restricted to its variables.
Shard 0 lives inside the chief's :class:`~.chief.SyncChief`, which also keeps ``global_step`` and
the token queue; shards 1.. are each a :class:`ShardServer` state machine, hosted on their own
server by :mod:`.servers`.

Per worker step::

    worker: push shard k's gradients to every shard k >= 1 at once, tagged local_step, and
            shard 0's with the chief's "step" (wait for a token), collecting the shards'
            answers meanwhile (``accepted`` and the shard's step); then "read" every shard
            1.. at once (values come back only if the shard stepped since the last read)
    shard:  when its accumulators hold R fresh gradients: average, apply with its optimizer
            copy, its step += 1; the effect :class:`Applied` makes the hosting code tell the
            chief before answering the push (the chief may answer the pusher's "step" first:
            the worker takes global_step as at least the smallest step its answers showed)
    chief:  global_step := min over shards of their step; every increment enqueues max(N, R)
            tokens (TF: global_step += 1 after all variables were updated, then tokens)

Shards check staleness independently, as TF's accumulators do: with backup workers a gradient
set can be accepted by one shard and dropped by another (TF's per-variable race); a worker's
``last_gradient_accepted`` is True iff every shard accepted it.  A shard may run one update
ahead of ``global_step``; a worker reads each shard's newest values after its token, as a TF
worker reads variables from several ps tasks (no cross-shard snapshot).

Optimizer state shared across variables (Adam's ``beta1_power``/``beta2_power``, kept per
param group): every shard's copy keeps every group and advances its own powers once per
update of that shard, i.e. once per global step; this equals TF's single shared pair as long
as every shard updates every step, which holds unless all of a shard's parameters receive
``None`` from every worker (that shard then skips its optimizer call and its powers lag).
Hyperparameters are re-read before each update from the wrapped optimizer of the rank that
hosts the shard (so LR schedules must run on every server rank, as they do when every rank
runs the same loop).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from ...common.apply import apply_gradients
from ...common.membership import Membership
from ...common.replies import Answer
from ..common.job import Job
from ..common.preconditioning import preconditioners
from ..layout.pieces import Piece, split_optimizer
from .aggregator import GradientAggregator
from .read_ahead import HeldPushes, push_answers, read_answer, release_answers, values_answer

__all__ = [
    "Applied",
    "Resized",
    "Shard",
    "pushed_gradients",
    "ShardServer",
    "shard_optimizer",
    "server_optimizer",
]

log = logging.getLogger(__name__)


def server_optimizer(
    opt: torch.optim.Optimizer,
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """A deep copy of ``opt`` over copies of its parameters (the server's variables).

    Copies the instance ``__dict__`` (``torch.optim.Optimizer.__getstate__`` would keep only
    groups/state/defaults and lose a subclass's own attributes)."""
    originals = [p for g in opt.param_groups for p in g["params"]]
    params = [p.detach().clone() for p in originals]
    memo: dict[int, Any] = {id(o): c for o, c in zip(originals, params, strict=True)}
    clone = object.__new__(type(opt))
    clone.__dict__.update({k: copy.deepcopy(v, memo) for k, v in opt.__dict__.items()})
    return clone, params


def shard_optimizer(
    opt: torch.optim.Optimizer, indices: Sequence[int], pieces: Sequence[Piece] | None = None
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """:func:`server_optimizer` keeping only the parameters ``indices`` (every param group is
    kept, possibly empty, so per-group shared state such as beta powers is kept too).
    ``pieces`` (``shard_assignment="split"``): ``indices`` are of these pieces, and the copy
    holds the pieces with their state sliced (:func:`.pieces.split_optimizer`)."""
    if pieces is not None:  # copies of this shard's pieces only
        return split_optimizer(opt, [pieces[i] for i in indices])
    clone, params = server_optimizer(opt)
    mine = [params[i] for i in indices]
    keep = {id(p) for p in mine}
    if len(mine) != len(params):
        for group in clone.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        for p in list(clone.state):
            if id(p) not in keep:
                del clone.state[p]
    return clone, mine


class Shard:
    """Variables ``indices`` of the model (of ``pieces`` when split: then the variables are
    the pieces, and moving averages are not supported), their accumulators and an optimizer
    copy."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        indices: Sequence[int],
        job: Job,
        pieces: Sequence[Piece] | None = None,
    ) -> None:
        self.source = opt  # hyperparameters (LR schedules) are re-read from here
        self.indices = list(indices)  # of the parameters, or of ``pieces`` when split
        self.opt, self.params = shard_optimizer(opt, self.indices, pieces)
        self.aggregator = GradientAggregator(self.params, job.R, job.nonfinite)
        self.aggregator.set_global_step(job.global_step)
        self.ema, self.last_step = job.ema, job.last_step
        chosen = set(job.averaged) if job.averaged else set(self.indices)
        self.averaged = [(j, i) for j, i in enumerate(self.indices) if i in chosen]
        self.loads = 0  # checkpoint loads: they change the variables without a step
        self.contributors: set[int] = set()  # workers whose gradient is in the pending update
        # a dedicated server's, or a replicated chief's: the workers' pushes carry the
        # hyperparameters (LR schedules run on the workers), ``source`` is not read
        self.follow_workers = False
        # a replicated chief (:mod:`...hosting.standby`): the primary keeps what each request
        # decided here (``keep``) for its standby's copy -- its offer's verdict and each
        # update's averages; the standby is ``given`` the averages instead of summing
        self.keep = False
        self.offered: str | None = None
        self.made: list[dict[str, Any]] = []
        self.given: deque[dict[str, Any]] = deque()
        self.given_updates = 0  # updates applied from the primary's averages

    def begin_request(self, keeping: bool, updates: Sequence[dict[str, Any]] = ()) -> None:
        """Before a request: a primary with a standby (``keeping``) keeps what it decides for
        its copy (:meth:`decided`); a standby's copy is ``given`` its primary's averages."""
        self.keep, self.offered = keeping, None
        self.made.clear()
        self.given.extend(updates)

    def decided(self, keeping: bool) -> dict[str, Any]:
        """What the last request decided that a copy cannot: the verdict on the gradients
        kept here, and the averages of the updates made; then kept afresh (``keeping``)."""
        out: dict[str, Any] = {}
        if self.offered is not None:
            out["verdict"] = self.offered
        if self.made:
            out["updates"] = list(self.made)
        self.begin_request(keeping)
        return out

    def check_given(self, name: str, op: Any) -> None:
        """After a copy: every update its primary made was made here (else a bug)."""
        if self.given:
            raise RuntimeError(
                f"SyncReplicas {name}'s standby: its primary made {len(self.given)} update(s) "
                f"in handling a {op!r} that this copy did not make"
            )

    @property
    def adaptive(self) -> bool:
        """``replicas_to_aggregate="auto"``: each update's R comes with the pushes (the chief
        chose it and sent it with the tokens), capped at the workers still live here, and
        every update measures its gradients' noise (:meth:`measure`)."""
        return self.aggregator.measure_noise

    def measure(self) -> None:
        """Make this shard adaptive (``replicas_to_aggregate="auto"``): the noise of its
        gradients as its optimizer preconditions them."""
        self.aggregator.measure_noise = True
        self.aggregator.noise_weights = partial(preconditioners, self.opt, self.params)

    def set_replicas(self, replicas: int) -> bool:
        """The pending update waits for ``replicas`` gradients from now on; True iff those in
        already made it (it is applied now: a worker left, and fewer are needed)."""
        replicas = max(int(replicas), 1)
        if replicas == self.aggregator.replicas_to_aggregate:
            return False
        past_end = self.last_step is not None and self.step >= self.last_step
        if not self.aggregator.set_replicas(replicas) or self.aggregator.counter == 0 or past_end:
            return False
        self.update()
        return True

    @property
    def values_key(self) -> tuple[int, int, int]:
        """Equal for equal variable values: replies carrying them may share one copy."""
        return (id(self), self.loads, self.step)

    @property
    def step(self) -> int:
        """Updates applied so far (the accumulators' ``current_global_step``)."""
        return self.aggregator.global_step

    def check_layout(self, worker: int, shapes: list, dtypes: list, where: str) -> None:
        mine = [list(p.shape) for p in self.params]
        if [list(s) for s in shapes] != mine:
            raise ValueError(
                f"SyncReplicasOptimizer: worker rank {worker} has parameter shapes {shapes}, the "
                f"server ({where}) has {mine}; every worker must build the same model"
            )
        theirs = [str(d) for d in dtypes]
        if theirs != [str(p.dtype) for p in self.params]:
            raise ValueError(f"SyncReplicasOptimizer: worker rank {worker} has dtypes {theirs}")

    def follow(self, hyper: Sequence[dict[str, Any]] | None) -> None:
        """A worker's numeric hyperparameters per param group (sent when they changed): a
        dedicated server, or a replicated chief and its standby, take them for the next
        update; a server inside a worker rank reads its own rank's optimizer instead."""
        if hyper is None or not self.follow_workers:
            return
        if len(hyper) != len(self.opt.param_groups):
            raise ValueError(
                f"SyncReplicasOptimizer: a worker has {len(hyper)} param groups, the server "
                f"{len(self.opt.param_groups)}"
            )
        for group, values in zip(self.opt.param_groups, hyper, strict=True):
            group.update(values)

    def push(
        self,
        worker: int,
        tag: int,
        grads: list[torch.Tensor | None] | None,
        verdict: str | None = None,
    ) -> tuple[bool, bool]:
        """Offer this shard's gradients: ``(accepted, updated)``; updates once R are in.
        ``grads`` None: the worker withheld them, knowing them stale (``withheld`` pushes,
        see :func:`.shard_clients.push_data`): counted as dropped.  ``verdict``: a standby's
        copy of a push whose gradients stayed with the primary, counted as it decided
        (:meth:`~.aggregator.GradientAggregator.count`)."""
        if self.last_step is not None and self.step >= self.last_step:
            log.debug("worker rank %d: gradient after last_step=%d ignored", worker, self.last_step)
            self._offered("ignored")
            return False, False
        if grads is None and verdict is None:
            self.aggregator.drop_withheld(worker, tag)
            self._offered("withheld")
            return False, False
        if verdict is not None:
            accepted = self.aggregator.count(worker, tag, verdict)
        else:
            assert grads is not None
            accepted = self.aggregator.push(worker, tag, grads)
        self._offered(self.aggregator.last_verdict)
        if accepted:
            self.contributors.add(worker)
        if not self.aggregator.ready():
            return accepted, False
        self.update()
        return accepted, True

    def _offered(self, verdict: str) -> None:
        if self.keep:
            self.offered = verdict

    def update(self) -> None:
        """TF's sync op for these variables: take the averages (a standby: its primary's),
        apply them, moving averages."""
        if self.given:
            made = self.given.popleft()
            self.aggregator.take_given(made["noise"])
            self.given_updates += 1
            averages = [
                None if g is None else g.to(p.device)
                for g, p in zip(made["averages"], self.params, strict=True)
            ]
        else:
            averages = self.aggregator.take_average()
        if self.keep:  # copies: the optimizer may change what it is given
            noise = self.aggregator.last_noise
            kept = [None if g is None else g.clone() for g in averages]
            self.made.append({"averages": kept, "noise": None if noise is None else list(noise)})
        self.contributors.clear()
        if not self.follow_workers:  # this rank's own optimizer (its LR schedule)
            for mine, theirs in zip(self.opt.param_groups, self.source.param_groups, strict=True):
                mine.update({k: v for k, v in theirs.items() if k not in ("params", "non_slot")})
        pairs = [(g, p) for g, p in zip(averages, self.params, strict=True) if g is not None]
        if pairs:
            apply_gradients(self.opt, pairs)
        if self.ema is not None and self.averaged:
            self.ema.apply({i: self.params[j] for j, i in self.averaged}, num_updates=self.step)

    def shadows(self) -> list[list[Any]]:
        """``[[index, moving average], ...]`` of this shard's averaged variables."""
        if self.ema is None:
            return []
        return [[i, self.ema.shadows[i]] for _, i in self.averaged if i in self.ema.shadows]

    def state_dict(self) -> dict[str, Any]:
        return {
            "indices": list(self.indices),
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.opt.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "shadows": [[i, s.clone()] for i, s in self.shadows()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["indices"]) != self.indices:
            raise ValueError(
                f"SyncReplicasOptimizer: checkpoint shard holds parameters {state['indices']}, "
                f"this shard {self.indices} (same server_ranks and model needed)"
            )
        shapes = [tuple(p.shape) for p in state["params"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(f"SyncReplicasOptimizer: checkpoint variables have shapes {shapes}")
        self.loads += 1
        self.aggregator.load_state_dict(state["aggregator"])
        self.opt.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, v in zip(self.params, state["params"], strict=True):
                p.copy_(v)
        if self.ema is not None:
            for i, s in state["shadows"]:
                self.ema.shadows[int(i)] = s.clone()


def pushed_gradients(msg: dict[str, Any]) -> list[torch.Tensor | None] | None:
    """A push's gradients, or None when the worker withheld them as stale (``withheld``:
    ``shard_clients.push_data``); a push with neither is malformed (``KeyError``)."""
    return None if msg.get("withheld") else msg["grads"]


@dataclass(frozen=True)
class Applied:
    """Effect: shard ``shard`` applied its update number ``step``.  The hosting code reports it
    to the chief (``applied``) before it sends the answers that follow in the same list.
    ``noise``: that update's noise terms over this shard's variables (``"auto"`` only)."""

    shard: int
    step: int
    noise: tuple[float, float, int] | None = None
    # a standby that took over: the workers whose gradients it withdrew, each with the number
    # of the push they came in (the chief has them send that step again)
    withdrawn: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Resized:
    """Effect (``replicas_to_aggregate="auto"``): the chief lowered the R of the update at
    ``step`` while it waited (a worker left or fell far behind).  The hosting code tells every
    other shard (``replicas``), which makes the update once that many gradients are in."""

    step: int
    replicas: int


class ShardServer:
    """State machine of one shard: ``hello``, ``push``, ``release``, ``read``, ``done``,
    ``stats``, ``ema`` and the chief's ``replicas``; ``handle`` returns answers and, after an
    update, the :class:`Applied` effect (before the answers it releases).  Shard 0's is the
    chief's (:class:`~.chief.SyncChief` adds ``global_step`` and the token line to it).

    A replicated shard (:mod:`...hosting.standby`): its workers number their pushes
    (``number``); a push sent again under the same number -- its worker moved here after the
    primary's loss -- gets the answer it was given and is not offered again.  The gradients
    never travel twice (under the one-gradient-per-worker rule, as the chief's): a push's copy
    leaves them out (``standby_replaced``) and carries what the primary decided from them
    instead (:meth:`copy_fields`): the verdict, and with the copy of the request that made an
    update, that update's averages, which the standby applies as they are.  So the primary's
    link carries one average per update to the standby, not every worker's gradients.  The
    standby only counts the pending update's gradients; when it takes over
    (:meth:`take_over`) it withdraws them, and reports their workers to the chief with its
    first report; the chief has each of them, which waits for that update's token, send its
    step again, and its gradient is offered again then (:meth:`_again`).  Under TF's shared
    token queue a worker may go on before the update its gradient joined, so there the workers
    send their gradients to the standby themselves (``standby_direct``).  A new standby starts
    from :meth:`replica_state`; hellos and push answers name the standby."""

    standby_early: tuple[str, ...] = ()

    def __init__(
        self,
        shard_id: int,
        shard: Shard,
        job: Job,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.k, self.shard, self.N, self.timeout = shard_id, shard, job.N, job.timeout
        self.name = f"shard {shard_id}" if name is None else name
        self.members = Membership(job.N, job.timeout, f"SyncReplicas {self.name}", clock)
        self.held = HeldPushes()
        self.lowered: tuple[int, int] | None = None  # (step, R) the chief lowered it to
        # replication: where the standby is (told in hellos and push answers); each worker's
        # last push number and the answer it was given
        self.standby: str | None = None
        self.standby_rank: int | None = None
        self.numbers: dict[int, int] = {}
        self.answered: dict[int, dict[str, Any]] = {}
        # what a push's copy leaves out (class docstring): under the one-gradient-per-worker
        # rule the gradients stay here and the copy carries the verdict and the averages
        replaced = job.tokens == "distinct"
        self.standby_replaced = {"push": ("grads",)} if replaced else {}
        self.standby_direct = {} if replaced else {"push": ("grads",)}
        # (a standby that took over) worker -> the number of the push to offer again
        self.withdrawn: dict[int, int] = {}

    def handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer | Applied]:
        if msg["op"] == "read":  # changes nothing (a standby's own rank reads it, following)
            return self._handle(msg, ticket)
        self.shard.begin_request(self._keeping, msg.get("updates", ()))
        out = self._handle(msg, ticket)
        self.shard.check_given(self.name, msg.get("op"))
        return out

    @property
    def _keeping(self) -> bool:
        """Does this server keep what each request decides, for its standby's copy?"""
        return self.standby is not None and bool(self.standby_replaced)

    def copy_fields(self) -> dict[str, Any]:
        """What the standby's copy of the request just handled carries besides it: the verdict
        on the gradients it kept here, and the averages of the updates it made."""
        return self.shard.decided(self._keeping)

    def take_over(self) -> None:
        """This standby takes its lost primary's place: the pending update's gradients it
        only counted (their sums stayed with the primary) are withdrawn; its first report to
        the chief names their workers (:meth:`withdrawn_pushes`), which send their step
        again, and each gradient is offered again then (:meth:`_again`)."""
        pending = sorted(self.shard.contributors)
        if not self.standby_replaced or not pending:
            return
        self.shard.aggregator.withdraw(pending)
        self.shard.contributors.clear()
        self.withdrawn = {w: self.numbers[w] for w in pending if w in self.numbers}
        log.warning("SyncReplicas %s (the standby, taking over): the gradients of worker "
                    "rank(s) %s for step %d are offered again as their steps come", self.name,
                    pending, self.shard.step)  # fmt: skip

    def withdrawn_pushes(self) -> tuple[tuple[int, int], ...]:
        """``(worker, push number)`` of each gradient withdrawn at the takeover and not yet
        offered again."""
        return tuple(sorted(self.withdrawn.items()))

    def _handle(self, msg: dict[str, Any], ticket: Any) -> list[Answer | Applied]:
        op = msg["op"]
        if op == "load_replica":  # a new standby starts from its primary's whole state
            self._load_replica(msg)
            return [Answer(ticket, {})]
        worker = int(msg["worker"])
        if op == "done":
            self.members.leave(worker, forgotten=bool(msg.get("forgotten", False)))
            left = self.held.drop(worker)  # a forgotten worker's held push: answer it
            out: list[Answer | Applied] = [Answer(ticket, {})]
            out += [] if left is None else [values_answer(self.shard, left)]
            if self.shard.adaptive:
                out += self.resize(self.shard.step, self.shard.aggregator.replicas_to_aggregate)
            return out
        if op == "release":
            return release_answers(self.shard, self.held, msg)
        if op == "replicas":  # from the chief (worker -1), not a worker's message
            self.lowered = (int(msg["step"]), int(msg["r"]))
            return [Answer(ticket, {}), *self.resize(int(msg["step"]), int(msg["r"]))]
        self.members.heard(worker)
        if op == "hello":
            self.shard.check_layout(worker, msg["shapes"], msg["dtypes"], self.name)
            self.members.hello(worker)
            self.numbers.pop(worker, None)  # a restarted worker's numbers start again
            self.answered.pop(worker, None)
            values = {"version": self.shard.step, "params": self.shard.params, **self._named()}
            # whether the worker sends its gradients to a standby too (now or once one attaches)
            values["standby_data"] = bool(self.standby_direct)
            return [Answer(ticket, values, self.shard.values_key)]
        if op == "push":
            number = msg.get("number")
            if number is not None and self.numbers.get(worker) == int(number):
                return self._again(worker, int(number), msg, ticket)
            self.withdrawn.pop(worker, None)  # a later step: that gradient is not coming
            accepted, updated = self.offer(msg)
            answers = push_answers(self.shard, self.held, msg, ticket, accepted, updated)
            if number is not None and "ahead" not in msg:  # kept for the same push again
                self.numbers[worker] = int(number)
                self.answered[worker] = dict(answers[0].payload)
                if self.standby is not None:
                    answers[0] = replace(
                        answers[0], payload={**answers[0].payload, **self._named()}
                    )
            return [self._applied(), *answers] if updated else list(answers)
        if op == "read":
            return [read_answer(self.shard, ticket, int(msg["version"]))]
        if op == "stats":
            return [Answer(ticket, {"stats": self.shard.aggregator.stats})]
        if op == "ema":
            return [Answer(ticket, {"shadows": self.shard.shadows()})]
        raise ValueError(f"unknown request {op!r}")

    def _named(self) -> dict[str, Any]:
        """Where the standby is, for the workers (nothing without one)."""
        if self.standby is None:
            return {}
        return {"standby": self.standby, "standby_rank": self.standby_rank}

    def _again(
        self, worker: int, number: int, msg: dict[str, Any], ticket: Any
    ) -> list[Answer | Applied]:
        """Worker ``worker``'s push ``number`` sent again (it moved here from a lost primary):
        the answer it was given, with where the standby is now, and nothing offered again --
        unless this standby withdrew that gradient when it took over: offered again now."""
        if self.withdrawn.get(worker) == number:
            del self.withdrawn[worker]
            accepted, updated = self.offer(msg)
            answer = {"accepted": accepted, "step": self.shard.step}
            self.answered[worker] = dict(answer)
            out = Answer(ticket, {**answer, **self._named()})
            return [self._applied(), out] if updated else [out]
        given = self.answered.get(worker)
        if given is None:
            raise RuntimeError(
                f"SyncReplicas {self.name}: worker rank {worker} sent push {number} again, "
                "but it was never answered"
            )
        return [Answer(ticket, {**given, **self._named()})]

    def replica_state(self) -> dict[str, Any]:
        """Everything a new standby starts from (its ``load_replica``): the shard's checkpoint
        state, the workers in its pending update, who left, each worker's last push number
        and its answer."""
        return {
            "shard": self.shard.state_dict(),
            "contributors": sorted(self.shard.contributors),
            "numbers": dict(self.numbers),
            "answered": dict(self.answered),
            "members": (sorted(self.members.left), sorted(self.members.forgotten)),
            "withdrawn": sorted(self.withdrawn.items()),
        }

    def _load_replica(self, state: dict[str, Any]) -> None:
        self.shard.load_state_dict(state["shard"])
        self.shard.contributors = set(state["contributors"])
        self.numbers, self.answered = dict(state["numbers"]), dict(state["answered"])
        self.withdrawn = {int(w): int(n) for w, n in state.get("withdrawn", ())}
        left, forgotten = state["members"]
        self.members.left, self.members.forgotten = set(left), set(forgotten)

    def offer(self, msg: dict[str, Any]) -> tuple[bool, bool]:
        """A worker's push (its hyperparameters, its update's R, its gradients or their
        withholding): ``(accepted, updated)``.  The R a push carries counts on shards 1..;
        shard 0's comes from the chief's own choice, which may since have lowered it."""
        self.shard.follow(msg.get("hyper"))
        tag = int(msg["tag"])
        if self.k and self.shard.adaptive and "r" in msg and tag == self.shard.step:
            lowered = self.lowered[1] if self.lowered and self.lowered[0] == tag else None
            r = min(int(msg["r"]), self._live(), lowered or int(msg["r"]))
            self.shard.aggregator.set_replicas(r)
        worker = int(msg["worker"])
        if "verdict" in msg and not msg.get("withheld"):  # a standby's copy, without the data
            return self.shard.push(worker, tag, None, str(msg["verdict"]))
        return self.shard.push(worker, tag, pushed_gradients(msg))

    def resize(self, step: int, replicas: int) -> list[Answer | Applied]:
        """The update at ``step`` waits for at most ``replicas`` gradients, and for no more
        than the live workers: made now if those already in are enough."""
        if self.shard.step != step or not self.shard.set_replicas(min(replicas, self._live())):
            return []
        due = self.held.due(self.shard.step)  # read-ahead pushes that waited for it
        return [self._applied(), *(values_answer(self.shard, h) for h in due)]

    def _applied(self) -> Applied:
        noise = self.shard.aggregator.last_noise if self.shard.adaptive else None
        return Applied(self.k, self.shard.step, noise)

    def _live(self) -> int:
        """Workers that have not left (at least one: R is never 0)."""
        return max(self.N - len(self.members.left), 1)

    def tick(self) -> list[Answer]:
        return []
