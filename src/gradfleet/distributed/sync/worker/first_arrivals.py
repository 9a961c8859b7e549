"""SyncReplicas with backup workers and no server: the first R of N workers all-reduce.

Every rank keeps a replica of the server's state (the variables, the wrapped optimizer's slots,
``global_step``), as :mod:`.allreduce` does for R == N.  Each update takes the gradients of
the first R workers ready at the current step, so the N - R slowest never hold it up: TF's
backup workers, without a host that holds the state alone.

* **Who** (:class:`~...transport.arrival_board.ArrivalBoard`): a worker whose gradient is ready
  counts itself in on the job's store; the first R places are the update's members on every
  rank, the first of them its *leader*.
* **The members** sum their gradients with all-reduces on a process group of their own (one per
  set of members, made the first time it is needed and kept), then divide: dense sums by R,
  sparse rows by the members that sent the row (gradfleet's one rule,
  :mod:`~...transport.all_reduce`), and apply them with their own copy of the wrapped
  optimizer.
* **The others** -- a worker that came after the first R, or one still computing -- drop their
  gradient (TF: a stale gradient is dropped) and receive the update point-to-point on the job's
  process group: each member sends one R-th of the sums (so no member's link carries more than
  a slice), the leader the flags of who sent what and the row counts.  From these they compute
  the same means and apply the same update, so every rank's state is bit-identical after every
  update.  A worker that is several updates behind receives each in
  turn, then computes its next gradient at the newest step, as TF's worker reads the newest
  variables.
* **Every worker heard** (:mod:`.deference`, ``hear_every_worker``): a worker late once would
  stay late, since it receives each update after the members; before counting in, a worker
  heard in many more recent updates than another, about as fast, waits briefly for that one
  to count in first, so the late place rotates.
* **Back-pressure**: a member keeps its slices of each update until the late workers have
  received them (gloo's send completes only then), at most :data:`SEND_WINDOW` updates; beyond
  that it waits for the oldest.  A worker that is slower still holds the others back to its
  pace of *receiving* updates, which is much faster than computing gradients -- unless its
  link is slow: every rank receives every update.
* **Losses** (:meth:`FirstArrivalsExchange._round` decides, once): without ``max_losses`` a
  lost peer ends the job, and the first rank to meet it says so on the store, where every
  waiting rank hears it.  With ``max_losses=K`` (at most N - R) the exchange's group is an
  :class:`~...transport.elastic_group.ElasticGroup` whose watcher every wait consults; a lost
  or silent member, or another member forming the next generation, makes the live ones form
  it and heal from the newest step (:meth:`.serverless.ServerlessExchange._change`), as the
  R == N exchange does; a restarted worker joins the same way.

Only ``tokens="distinct"`` (one gradient per worker per update).  R is fixed, or chosen before
every update by a policy (``replicas_to_aggregate="auto"``): every rank keeps the policy's
measurements and folds the same ones in after each update -- the rounds the update's leader
read on the store, the noise terms that come with the update -- so every rank makes the same
choice (:meth:`FirstArrivalsExchange._measure`).  A non-finite
gradient with ``nonfinite="raise"`` raises on its own rank before it is sent, so nothing
changes anywhere.  Gloo only (CPU tensors): NCCL's point-to-point under these patterns is not
measured yet.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ...transport import LINK_ERRORS, gloo_link
from ...transport.all_reduce import GradientMean
from ...transport.arrival_board import ArrivalBoard, Made
from ...transport.world_group import WorldGroup
from ..common.job import Job
from ..common.outcome import Outcome
from ..common.preconditioning import preconditioners, weighted_sum_sq
from ..common.replica_choice import ReplicaChoice
from .deference import MARGIN, RECENT, Deference
from .serverless import ServerlessExchange, any_nonfinite, nonfinite_screen

__all__ = ["SEND_WINDOW", "FirstArrivalsExchange"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"
SEND_WINDOW = 4  # updates a member may still be sending to late workers
_POLL = 0.002  # seconds between a deferring worker's looks at the store


class FirstArrivalsExchange(ServerlessExchange):
    """R < N SyncReplicas without a server (module docstring)."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        job: Job,
        store: dist.Store | None = None,
        group: Any = None,
    ) -> None:
        """``store``: where the workers count their arrivals (default: the job's); ``group``:
        an :class:`~...transport.elastic_group.ElasticGroup` where losses are allowed (one
        that is joining makes this rank heal from a live member before it returns)."""
        self.check(job, opt)
        R, N = job.R, job.N
        elastic = group is not None
        group = WorldGroup(timeout=job.timeout) if group is None else group
        joining = group.generation > 0 or group.size != N
        super().__init__(opt, job, group, joining)
        self.max_losses = job.max_losses
        # each update's R: fixed, or chosen by the policy from what every rank measured alike
        self.choice = ReplicaChoice(R, job.policy)
        self.auto = job.policy is not None
        self._noise_weights: list[torch.Tensor | None] | None = None  # this update's P
        self._last_made_at: float | None = None  # when this rank last applied an update
        self._first_at = 0.0  # when the first R of this update were known (the leader's)
        self.R = R
        if elastic:
            store = group.root
        elif store is None:
            store = dist.distributed_c10d._get_default_store()
        self.board = ArrivalBoard(
            store, self.rank, N, job.timeout, group.watcher, "elastic" if elastic else None
        )
        self.history: list[list[int]] = []  # the members of each update made since the start
        self.deference = Deference(N, MARGIN if job.hear_every_worker else math.inf)
        self._returned: float | None = None  # when this rank's last step ended
        self._sending: deque[tuple[list[Any], list[torch.Tensor]]] = deque()
        self._dropped_before = {r: 0 for r in range(N)}  # from a loaded state
        if joining:  # a restarted rank: from a live member's state
            self.global_step = -1
            self._change(check_losses=False)
            self.board.new_generation(self.group.generation)
            self.start_step = self.local_step = self.global_step
        else:
            self.start()
        self._decide()

    @staticmethod
    def check(job: Job, opt: torch.optim.Optimizer) -> None:
        """What this exchange refuses, before any group is made."""
        R, N = job.R, job.N
        if job.tokens != "distinct":
            raise ValueError(
                f"{_OWNER}: transport='allreduce' with replicas_to_aggregate={R} < "
                f"total_num_replicas={N} takes one gradient per worker per update "
                "(tokens='distinct'); TF's shared token queue needs transport='server'"
            )
        fewest = 1 if job.policy is not None else R  # a chosen R follows the live workers
        if job.max_losses > N - fewest:
            raise ValueError(
                f"{_OWNER}: max_losses={job.max_losses} would leave fewer than "
                f"replicas_to_aggregate={fewest} of the {N} workers"
            )
        if any(p.is_cuda for g in opt.param_groups for p in g["params"]):
            raise ValueError(
                f"{_OWNER}: transport='allreduce' with replicas_to_aggregate < "
                "total_num_replicas takes CPU parameters only for now (gloo: NCCL's "
                "point-to-point under these patterns is not measured yet); use "
                "transport='server'"
            )

    # ------------------------------------------------------------------ the round
    def step(
        self, local_step: int, grads: list[torch.Tensor | None], stream: bool = True
    ) -> Outcome:
        """One round with this rank's ``grads`` (nothing is ever left to read)."""
        self.local_step = int(local_step)
        if self._returned is not None:  # since the last step ended: this gradient's time
            self.deference.computed(time.monotonic() - self._returned)
        outcome = Outcome(*self._round(grads))
        self._returned = time.monotonic()
        return outcome

    def _round(self, grads: list[torch.Tensor | None]) -> tuple[bool, int, int]:
        """The one place a lost peer is decided on: without ``max_losses`` the job ends
        (every rank hears it); with it, the live members form the next generation and heal,
        then this gradient goes into the next update if the state did not move meanwhile."""
        while True:
            start = self.global_step
            try:
                if self.group.joiners_waiting:  # a restarted worker asks in
                    self._regroup(None)
                return self._take_part(grads)
            except LINK_ERRORS as exc:
                if not self.max_losses:
                    raise self._lost(exc) from None
                self._regroup(exc)
            if self.global_step != start:  # made meanwhile: this gradient is stale
                self.board.count_dropped()
                return False, self.global_step, self.global_step

    def _regroup(self, exc: BaseException | None) -> None:
        """A member lost (``exc``) or one asking in: the next generation, healed from the
        member holding the newest step; new buffers (an abandoned collective may still
        write into the old ones) and fresh arrivals."""
        if exc is not None:
            log.warning("rank %d: a member of the update is lost: %s", self.rank, exc)
        self._sending.clear()
        self.buckets = self._make_buckets()
        self._change(check_losses=exc is not None)
        self._decide()  # a chosen R follows the live workers; a fixed one must stay reachable
        if self.group.size < self.R:
            raise RuntimeError(
                f"{_OWNER}(transport='allreduce'): rank {self.rank}: {self.group.size} workers "
                f"left, fewer than replicas_to_aggregate={self.R}"
            )
        self.board.new_generation(self.group.generation)

    def _decide(self) -> None:
        """The R of the update at the current step: fixed, or the policy's choice from the
        measurements, which are the same on every rank (so is the choice)."""
        self.R = self.choice.decide(self.global_step, self.group.members, 0.0)

    def _measure(
        self, step: int, averages: list[torch.Tensor | None], sum_sq: float, made: Any
    ) -> None:
        """The update at ``step`` is applied: with a policy, its rounds (as its leader read
        them, each with the update's exchange), its interval, and its gradient noise
        (``sum_sq``: the members' summed ``g_i^T P g_i``, ``P`` the optimizer's preconditioner;
        the mean's from ``averages``) join the measurements, in the same order on every rank;
        then the next update's R."""
        if self.auto:
            measured = self.choice.measured
            # a round here is a gradient's seconds: the update's exchange, which the chief's
            # rounds hold (a push's transfer), is added, so that T(R) is an update's cost
            for r in sorted(made.rounds):
                measured.timed(r, made.rounds[r] + (made.exchange or 0.0))
            self._last_made_at = time.monotonic()
            mean_sq = float(weighted_sum_sq(averages, self._noise_weights))
            measured.noise(step, sum_sq, mean_sq, len(made.members))
        # the leader's interval since the update before: the same on every rank
        self.choice.made(step, interval=made.interval, live=self.group.members)
        self._decide()

    def _take_part(self, grads: list[torch.Tensor | None]) -> tuple[bool, int, int]:
        if self._released():
            return False, self.global_step, self.global_step
        if self.local_step < self.global_step:  # a gradient of an old step: TF drops it
            self.board.count_dropped()
            return False, self.global_step, self.global_step
        cpu = torch.device("cpu")
        if (
            self.nonfinite == "raise"
            and nonfinite_screen(grads, cpu).item()
            and any_nonfinite(grads, cpu).item()
        ):
            raise FloatingPointError(
                f"{_OWNER}: non-finite gradient on rank {self.rank}; it was not sent "
                "(nothing changed on any rank)"
            )
        step = self.global_step
        self._defer(step)
        place = self.board.arrive(step, self.deference.last())
        if place > self.R:  # the update is the first R's: receive it
            self._catch_up()  # (a loss meanwhile: _round counts the gradient, or reuses it)
            self.board.count_dropped()
            return False, self.global_step, self.global_step
        order = self.board.first(step, self.R)
        self._first_at = time.monotonic()  # the exchange of the update starts
        members = sorted(order)
        averages, (flags, rows) = self._reduce(grads, members)
        self._apply(averages, members)
        made = self._send(step, order, flags, rows)
        self._measure(step, averages, float(flags[-1]) if self.auto else 0.0, made)
        return True, self.global_step, self.global_step

    def _defer(self, step: int) -> None:
        """Before counting in: wait for the workers this one owes (:mod:`.deference`), at
        most the grace, or until the step has its R without them."""
        candidates = self.deference.candidates(self.rank, step, self.history, self.group.members)
        if not candidates:
            return
        board = self.board
        owed = self.deference.owed(candidates, board.lately(step, candidates, RECENT))
        if not owed:
            return
        started = time.monotonic()
        deadline = started + self.deference.grace()
        while True:
            came = board.came(step, owed)
            if len(came) == len(owed) or time.monotonic() >= deadline:
                break
            if board.arrivals(step) >= self.R:  # made without them: nobody is judged
                owed = came = []
                break
            time.sleep(_POLL)
        self.deference.settle(step, owed, came, time.monotonic() - started)

    def _reduce(
        self, grads: list[torch.Tensor | None], members: list[int]
    ) -> tuple[list[torch.Tensor | None], tuple[torch.Tensor, list[torch.Tensor]]]:
        """The members' mean gradients, and with the buckets' sums what makes them: the
        summed flags and any row counts (what the late workers receive)."""
        group = self._group(members)
        reduce = partial(self._all_reduce, group)
        for i, g in enumerate(grads):
            self.buckets.fill(i, g)
        works = [self._all_reduce(group, flat, True) for flat in self.buckets.flat]
        if group is not None:
            self.bytes_sent += sum(f.numel() * f.element_size() for f in self.buckets.flat)
        mean = GradientMean(self.params, len(members), reduce, self.group.device, _OWNER)
        flags = mean.flags(grads, extra=int(self.auto))
        if self.auto:  # the noise of the update (replicas_policy): sum over members of g^T P g
            self._noise_weights = preconditioners(self.opt, self.params)
            flags[-1] = float(weighted_sum_sq(grads, self._noise_weights))
        reduce(flags)
        for work in works:
            if work is not None:
                self.group.wait(work)
        kept: list[torch.Tensor] = []  # the row counts, as the members summed them

        def rows(t: torch.Tensor) -> None:
            reduce(t)
            kept.append(t)

        mean.all_reduce = rows
        slots = [self.buckets.slot[i] for i in range(len(self.params))]
        averages = mean.means(grads, slots, flags)
        return averages, (flags, kept)

    def _apply(self, averages: list[torch.Tensor | None], members: list[int] | tuple[int, ...]):
        self.apply_update(averages)
        self.deference.updated(time.monotonic())
        for r in members:
            self.stats[r]["accepted"] += 1
        self._replicas.append(len(members))
        self.history.append(sorted(members))

    # ------------------------------------------------------------------ the late workers
    def _send(
        self, step: int, order: list[int], flags: torch.Tensor, rows: list[torch.Tensor]
    ) -> Made:
        """Every member: its slice of each bucket's sums to every worker that is not a member
        (member k of the sorted members sends the k-th of R slices, so each member's link
        carries 1/R of the sums); the leader also sends the flags and row counts, then says
        the update is made.  Copies: the buckets are this rank's next round's."""
        members = sorted(order)
        late = [r for r in self.group.members if r not in members]
        k = members.index(self.rank)
        payload = [flat.tensor_split(len(members))[k].clone() for flat in self.buckets.flat]
        leader = order[0] == self.rank
        if leader:
            payload = [flags, *payload, *rows]
        works = [self.group.isend(t, r) for r in late for t in payload]
        self.bytes_sent += len(late) * sum(t.numel() * t.element_size() for t in payload)
        self._sending.append((works, payload))
        while len(self._sending) > SEND_WINDOW:
            self._finish_oldest_send()
        if not leader:  # the leader's record: the rounds that every rank measures alike
            return self.board.wait_made(step) if self.auto else Made(order[0], tuple(order))
        if not self.auto:
            self.board.made(step, self.rank, order)
            return Made(self.rank, tuple(order))
        rounds = self.board.lately(step + 1, self.group.members, RECENT)
        now, last = time.monotonic(), self._last_made_at
        interval = None if last is None else now - last
        exchange = now - self._first_at
        self.board.made(step, self.rank, order, rounds, interval, exchange)
        return Made(self.rank, tuple(order), rounds, interval, exchange)

    def _finish_oldest_send(self) -> None:
        works, _ = self._sending.popleft()
        for work in works:
            self.group.wait(work)

    def _catch_up(self) -> None:
        """This rank came after the first R: receive the update at its step, and each later
        one already made, so that its next gradient is of the newest step."""
        made = self.board.wait_made(self.global_step)
        while True:
            self._receive(made)
            # an update still being made is not waited for: this rank computes at the newest
            # step and counts in there (late, it is dropped; owed, the others wait for it)
            if self._released() or not self.board.is_made(self.global_step):
                return
            made = self.board.wait_made(self.global_step)

    def _receive(self, made: Any) -> None:
        """The update ``made``: the flags from its leader, each member's slice of the sums,
        the row counts from the leader; then the same means, the same update."""
        n, leader, members = len(self.params), made.leader, sorted(made.members)
        flags = torch.zeros(2 * n + int(self.auto), dtype=torch.float64)
        self.group.wait(self.group.irecv(flags, leader))
        works = [
            self.group.irecv(part, member)
            for flat in self.buckets.flat
            for member, part in zip(members, flat.tensor_split(len(members)), strict=True)
        ]
        for work in works:
            self.group.wait(work)

        def rows(t: torch.Tensor) -> None:  # the row counts, as the members summed them
            self.group.wait(self.group.irecv(t, leader))

        mean = GradientMean(self.params, len(members), rows, self.group.device, _OWNER)
        slots = [self.buckets.slot[i] for i in range(n)]
        step = self.global_step
        averages = mean.means([None] * n, slots, flags)
        if self.auto:  # the members' preconditioner: the state before the update, as theirs
            self._noise_weights = preconditioners(self.opt, self.params)
        self._apply(averages, made.members)
        self._measure(step, averages, float(flags[-1]) if self.auto else 0.0, made)

    # ------------------------------------------------------------------ transport
    def _group(self, members: list[int]) -> Any:
        """The members' own process group (None: a member alone needs none); a lost member
        while it forms raises one of ``LINK_ERRORS`` (:meth:`_round` ends the job)."""
        if len(members) == 1:
            return None
        with gloo_link("a member of the update", "forming its group"):
            return self.board.members_group(members)

    def _all_reduce(self, group: Any, tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Sum ``tensor`` over the members' ``group`` (None: alone), waited for through the
        job's group, which watches the members where losses are allowed."""
        if group is None:
            return None
        with gloo_link("a member of the update", "all_reduce"):
            handle = self.group.hold(group.allreduce([tensor]))
        if async_op:
            return handle
        self.group.wait(handle)
        return None

    def _lost(self, exc: BaseException) -> RuntimeError:
        """A lost peer: the job's end, said plainly here and told to every rank."""
        log.error("rank %d: the first-arrivals exchange lost a peer: %s", self.rank, exc)
        self.board.end(f"rank {self.rank}: {str(exc).splitlines()[0]}")
        return RuntimeError(
            f"{_OWNER}(transport='allreduce', replicas_to_aggregate={self.R}): rank "
            f"{self.rank}: a peer is gone or silent (a lost worker ends the job): "
            f"{str(exc).splitlines()[0]}"
        )

    def close(self) -> None:
        """Finish sending what late workers still have to receive (each receives in its next
        ``step()``: a worker that stopped stepping is given ``timeout`` seconds, then left
        with a warning), then let go of the members' groups and the job's."""
        try:
            while self._sending:
                self._finish_oldest_send()
        except (RuntimeError, *LINK_ERRORS) as exc:  # it left, or is gone: nothing to wait for
            log.warning(
                "rank %d: closing: a late worker did not receive the last updates: %s",
                self.rank, exc,
            )  # fmt: skip
        finally:
            self._sending.clear()
            self.board.close()
            # where losses are allowed: stop the heartbeat and release the group now, not at
            # the interpreter's exit, which would end a thread inside gloo or the store
            # ("terminate called without an active exception")
            self.group.close()

    # ------------------------------------------------------------------ books
    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]:
        """Each worker's gradients in updates (the same on every rank) and after the first
        R (counted on the store as they come)."""
        counts = {r: dict(c) for r, c in super().worker_counters(shard).items()}
        for r, n in self.board.dropped().items():
            counts[r]["dropped"] = self._dropped_before[r] + n
        return counts

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["stats"] = {int(k): dict(v) for k, v in self.worker_counters().items()}
        state["replicas"] = self.choice.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.choice.load_state_dict(state.get("replicas"))
        self._decide()
        self.board.new_epoch()
        self._dropped_before = {r: int(self.stats[r]["dropped"]) for r in self.stats}

    def _books(self) -> dict[str, Any]:
        """What a member healing from this one takes: the state, the members of each update
        and the store's epoch (a restarted process's board starts at 0)."""
        return {
            **super()._books(), "history": self.history, "epoch": self.board.epoch,
            "dropped_before": self._dropped_before,
        }  # fmt: skip

    def _load_books(self, books: dict[str, Any]) -> None:
        super()._load_books(books)  # a loaded state: a new epoch, then the members' own
        self.board.new_epoch(books["epoch"])
        self.history = [list(m) for m in books["history"]]
        self._dropped_before = {int(r): int(n) for r, n in books["dropped_before"].items()}
