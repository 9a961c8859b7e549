"""SyncReplicas without a server: R == N workers sum their gradients with all-reduces.

When every one of the N workers contributes to every update (no backup workers), the server's
state machine is the same on every rank, so each rank keeps a replica of it and the gradients
travel as DDP's do: in buckets, all-reduced, and -- with ``overlap`` -- while backward still
computes the earlier layers.

* **Buckets** (:class:`.buckets.Buckets`): DDP's, the parameters in reverse order, about 25 MiB
  each (the first about 1 MiB); a parameter's slot holds its dense gradient, or its sparse
  gradient's rows summed into it.
* **Overlap**: a post-accumulate-grad hook copies each gradient into its slot; a bucket whose
  slots are all in is all-reduced at once, asynchronously, buckets strictly in order so that
  every rank issues the same collectives in the same order.  ``step()`` fills and sends the
  buckets backward did not complete (a parameter that got no gradient), then the last bucket,
  which backward never sends: after its gradients it carries the step's flags, per parameter
  and rank (:attr:`.buckets.Buckets.tail`; one all-reduce of their own where the last bucket
  is not float32 or float64) -- which ranks had a gradient (dense or sparse), a possibly
  non-finite one, or **changed a gradient after it was sent** (clipping, ``GradScaler``
  unscaling, a second backward: the gradient's version counter moved, or it is another
  tensor).  The flags riding on the gradients save a collective's round trip per step (on 4
  loopback ranks, 1M parameters: 6 ms of a 40 ms step); where losses are allowed they keep
  their own all-reduce, the round's commit (:meth:`AllReduceExchange._make_buckets`).  If
  any rank changed one, every rank sends all buckets again from the gradients as ``step()``
  sees them and overlap is off from then on (logged once): the update is always made from
  the gradients as they stand at ``step()``, as TF's ``apply_gradients`` makes it, never from
  a copy taken earlier.  A possibly non-finite gradient (a fast screen,
  :func:`.serverless.nonfinite_screen`) makes every rank check its own exactly and say so in
  one more all-reduce, before anything is applied.
* **The update**: dense sums divided by N (a gradient that is None counts as zeros; a
  parameter with no gradient on any rank stays untouched), sparse rows divided by the number of
  ranks that sent the row (their counts travel in one more small all-reduce, only when some
  rank had a sparse gradient) -- the server's accumulator rule, gradfleet's one rule
  (:mod:`gradfleet.distributed.transport.all_reduce`) -- applied with each rank's own copy of the
  wrapped optimizer (identical on every rank: the parameters are broadcast from rank 0 at the
  start, as the server's variables are read by every worker).
* **Tokens**: ``"distinct"``, every update takes one gradient per worker, so ``local_step ==
  global_step`` always; ``"shared"`` replays TF's token queue (``num_tokens`` initial tokens, N
  per update): a round whose tag is stale (TF's wasted round after start-up) is dropped by every
  rank without communication.

The numbers are the server's with the workers in lockstep, up to the order in which the N
gradients are summed; there is no straggler tolerance: every update waits for the slowest
rank.  A dead rank makes the all-reduce fail, unless the job allows losses.

**Losses allowed** (``max_losses`` > 0): the collectives run on an
:class:`~...transport.elastic_group.ElasticGroup` instead of the job's process group.  When
one fails (a member died), the survivors form the group's next generation and *heal*: every
member says which ``global_step`` it holds, and the first member holding the newest sends its
state -- parameters, the wrapped optimizer's ``state_dict()``, the exchange's books -- to the
ones behind (:class:`.live_state.LiveState`; every rank already holds the full state, so
nothing is read from disk).  Then the round is decided:

* some member had finished the update before the loss (its collectives completed, so every
  member's gradient was in it): the others now hold it too, and the round is accepted;
* nobody had: the survivors redo it among themselves, from the gradients as ``step()`` has
  them, divided by the members left.

No update is applied twice or lost; from then on each dense sum is divided by the members
present.  A restarted rank joins the same way (:meth:`AllReduceExchange.__init__` with a
joining group): the members see its request in a step's flags, make that update, form the
next generation with it and heal it, so the job is back at N and a later loss is survived
again.  More than ``max_losses`` members gone at once ends the job with an error naming them.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from ...transport import LINK_ERRORS
from ...transport.all_reduce import GradientMean
from ...transport.world_group import WorldGroup
from ..common.job import Job
from ..common.outcome import Outcome
from .buckets import Buckets
from .serverless import ServerlessExchange, any_nonfinite, nonfinite_screen

__all__ = ["AllReduceExchange"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"


def _mark(g: torch.Tensor | None) -> tuple[int, int] | None:
    """What identifies a gradient's contents: its storage and its version counter (an
    in-place change moves the counter; a ``detach()``ed view shares both)."""
    if g is None:
        return None
    data = g._values() if g.is_sparse else g
    return data.data_ptr(), g._version


class AllReduceExchange(ServerlessExchange):
    """R == N SyncReplicas with all-reduces and a replica of the server's state on every rank
    (module docstring)."""

    def __init__(
        self, opt: torch.optim.Optimizer, job: Job, overlap: bool = True, group: Any = None
    ) -> None:
        """``group``: the members' collectives (default: the job's process group, every rank;
        an :class:`~...transport.elastic_group.ElasticGroup` where losses are allowed -- one
        that is joining makes this rank heal from a live member before it returns)."""
        N, tokens, num_tokens = job.N, job.tokens, job.initial_tokens
        if tokens == "shared" and num_tokens % N:
            raise ValueError(
                f"{_OWNER}: transport='allreduce' with tokens='shared' needs num_tokens to be a "
                f"multiple of total_num_replicas ({N}), got {num_tokens}"
            )
        if job.max_losses and tokens != "distinct":
            raise ValueError(
                f"{_OWNER}: max_losses needs tokens='distinct' (the shared token queue counts "
                f"N={N} tokens per update, and the members change)"
            )
        group = WorldGroup() if group is None else group
        joining = group.generation > 0 or group.size != N
        self.max_losses = job.max_losses  # before the buckets are laid out (their tail)
        super().__init__(opt, job, group, joining)
        self.sent_in_backward = 0  # buckets a gradient hook sent (overlap at work)
        self.overlap = overlap and self.world > 1
        self._hooks: list[Any] = []
        self._sent: dict[int, tuple[int, int] | None] = {}  # parameter -> what was sent
        self._works: list[Any] = []  # the buckets' all-reduces this round, in order
        self._filled: list[set[int]] = [set() for _ in range(len(self.buckets))]
        self._waiting_for: list[set[int]] = []
        self._broken: BaseException | None = None  # a link error a gradient hook met
        if joining:  # a restarted rank: from a live member's state
            self.global_step = -1
            while True:
                try:
                    self._heal()
                    break
                except LINK_ERRORS as exc:  # a member lost while it joined: the next generation
                    log.warning("rank %d: a member was lost while joining: %s", self.rank, exc)
                    self.group.reform()
                    self.world = self.group.size
            self.start_step = self.local_step = self.global_step
        else:
            self.start()
        if self.overlap:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._hook, i)))
        self._new_round()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.overlap = False
        self.group.close()

    # ------------------------------------------------------------------ overlap
    def _new_round(self) -> None:
        """Forget the last round's sends; re-read trainability (a parameter unfrozen since
        gets counted, a frozen one no longer holds its bucket back)."""
        self._sent.clear()
        self._works = []
        for s in self._filled:
            s.clear()
        self._waiting_for = [
            {i for i in idx if self.params[i].requires_grad} for idx in self.buckets.members
        ]

    def _armed(self) -> bool:
        """Will this round's gradients be all-reduced (so hooks may send them early)?"""
        return self.overlap and not self._released() and not self._stale()

    def _make_buckets(self) -> Buckets:
        """With a tail for the flags (module docstring), laid out for N ranks: the members'
        slots are their places in the group.  Not where losses are allowed: there the flags'
        own all-reduce is the round's commit.  A member the others gave up on (stopped, then
        back) completes the collective they abandoned -- gloo cannot cancel it -- and with
        the flags riding on it would make that round's update alone; the flags' all-reduce,
        which the others never issue, fails instead, and it rejoins and heals."""
        return Buckets(self.params, tail=0 if self.max_losses else self._flag_count())

    def _flag_count(self) -> int:
        """Per parameter dense and sparse; per rank non-finite and changed; joiners."""
        return 2 * len(self.params) + 2 * self.N + 1

    def _sent_by_hooks(self) -> int:
        """How many buckets backward's hooks may send: all but a last one carrying the flags."""
        return len(self.buckets) - (self.buckets.tail is not None)

    def _hook(self, i: int, param: torch.Tensor) -> None:
        b = self.buckets.bucket_of[i]
        held = self._sent_by_hooks()
        if not self._armed() or b < len(self._works) or b >= held or param.grad is None:
            return  # bucket already sent: step() sees the changed gradient and resends
        if self._broken is not None:
            return  # the group is broken: step() re-forms it and sends everything
        self.buckets.fill(i, param.grad)
        self._sent[i] = _mark(param.grad)
        self._filled[b].add(i)
        self._waiting_for[b].discard(i)
        try:
            while len(self._works) < held and not self._waiting_for[len(self._works)]:
                self._send(len(self._works))
                self.sent_in_backward += 1
        except LINK_ERRORS as exc:  # losses allowed: backward goes on, step() re-forms
            self._broken = exc

    def _send(self, b: int) -> None:
        """All-reduce bucket ``b`` (asynchronously); a slot that backward left empty (a
        frozen parameter) goes as its current gradient, noted like the others."""
        for i in self.buckets.members[b]:
            if i not in self._filled[b]:
                g = self.params[i].grad
                self.buckets.fill(i, g)
                self._sent[i] = _mark(g)
        flat = self.buckets.flat[b]
        work = self._collective(self.group.all_reduce, flat, True)
        self._works.append(work)
        tail = self.buckets.tail
        carried = tail.numel() if tail is not None and b == len(self.buckets) - 1 else 0
        self.bytes_sent += (flat.numel() - carried) * flat.element_size()

    # ------------------------------------------------------------------ the round
    def _stale(self) -> bool:
        return self.local_step < self.global_step

    def _take_token(self) -> int:
        if self.rule == "distinct" or self._released():
            return self.global_step
        values = [self.tokens.get() for _ in range(self.N)]
        if values[0] is None:
            raise RuntimeError(f"{_OWNER}: no token left (num_tokens too small)")
        return int(values[self.rank])  # type: ignore[arg-type]

    def step(
        self, local_step: int, grads: list[torch.Tensor | None], stream: bool = True
    ) -> Outcome:
        """One round with this rank's ``grads`` (``stream``: nothing is ever left to read)."""
        self.local_step = int(local_step)
        try:
            outcome = Outcome(*self._round(grads))
        finally:
            self._new_round()
        # the next round's tag, as the optimizer will pass it: backward's hooks send its
        # buckets unless it is stale (before, they waited for step() to say so, and overlap
        # worked in the first round only)
        self.local_step = outcome.local_step
        return outcome

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.local_step = -1  # the next round's tag is unknown until step(): no hook sends

    def _round(self, grads: list[torch.Tensor | None]) -> tuple[bool, int, int]:
        if self._released():  # every rank knows: nothing is sent, nothing applied
            return False, self.global_step, self.global_step
        if self._stale():  # every rank holds the same stale tag
            log.debug(
                "rank %d: stale round dropped on every rank (tag %d, global step %d)",
                self.rank, self.local_step, self.global_step,
            )  # fmt: skip
            for s in self.stats.values():
                s["dropped"] += 1
            return False, self._take_token(), self.global_step
        start = self.global_step
        while True:
            try:
                averages, joiners = self._reduce(grads)
                break
            except LINK_ERRORS as exc:  # with max_losses only (else _collective says it)
                self._recover(exc)
                if self.global_step > start:  # made before the loss: every gradient was in it
                    return True, self._take_token(), self.global_step
                self._new_round()  # nobody made it: the members left redo it
        self.apply_update(averages)
        if self.rule == "shared":
            self.tokens.put(self.global_step, self.N)
        for r in self.group.members:
            self.stats[r]["accepted"] += 1
        self._replicas.append(self.world)
        if joiners:
            self._grow()
        return True, self._take_token(), self.global_step

    def _reduce(self, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], bool]:
        """Sum every member's gradients: the averages (module docstring), and whether a
        restarted rank asks to join (any member saw it)."""
        if self._broken is not None:  # a gradient hook met it
            exc, self._broken = self._broken, None
            raise exc
        n, me, size, N = len(grads), self.group.index, self.world, self.N
        changed = False
        for i, g in enumerate(grads):
            b = self.buckets.bucket_of[i]
            if b < len(self._works):  # sent during backward: is it still what step() sees?
                changed |= _mark(g) != self._sent[i]
            else:
                self.buckets.fill(i, g)
                self._filled[b].add(i)
        # the buckets backward did not complete, in order, then the last with the flags
        while len(self._works) < self._sent_by_hooks():
            self._send(len(self._works))
        reduce = partial(self._collective, self.group.all_reduce)
        mean = GradientMean(self.params, size, reduce, self._device, _OWNER)
        # after the senders' flags: per rank (its place in the group) non-finite and changed,
        # and one for joiners
        flags = mean.flags(grads, extra=2 * N + 1)
        if self.nonfinite == "raise":  # a tensor op: no host synchronisation per gradient
            flags[2 * n + me] = nonfinite_screen(grads, flags.device)
        flags[2 * n + N + me] = float(changed)
        flags[2 * n + 2 * N] = float(self.group.joiners_waiting)
        tail = self.buckets.tail
        if tail is not None:
            tail.copy_(flags)
            self._send(len(self._works))
            self._wait()
            flags = tail.to(device="cpu", dtype=torch.float64, copy=True)  # the tail is reused
        else:
            self._wait()
            self._collective(self.group.all_reduce, flags)
            flags = flags.cpu()
        members = self.group.members
        if any(flags[2 * n + r] > 0 for r in range(size)):
            bad = self._nonfinite_ranks(grads)
            if bad:
                raise FloatingPointError(
                    f"{_OWNER}: non-finite gradient from rank(s) {bad}; it was not applied "
                    "(nothing changed)"
                )
        resend = [members[r] for r in range(size) if flags[2 * n + N + r] > 0]
        if resend:
            self._resend(grads, resend)
        # the slots are the means' (they are filled again next round)
        slots = [self.buckets.slot[i] for i in range(n)]
        averages = mean.means(grads, slots, flags, in_place=True)
        return averages, bool(flags[2 * n + 2 * N] > 0)

    def _nonfinite_ranks(self, grads: list[torch.Tensor | None]) -> list[int]:
        """A rank's screen said it may hold a non-finite gradient (every rank sees it in the
        summed flags, and comes here): each checks exactly, one more all-reduce, and the
        ranks that really hold one are named (none: finite values whose squares overflowed
        the screen's norm, and the update goes on)."""
        exact = torch.zeros(self.world, dtype=torch.float64, device=self._device)
        exact[self.group.index] = any_nonfinite(grads, exact.device)
        self._collective(self.group.all_reduce, exact)
        return [self.group.members[r] for r, v in enumerate(exact.cpu().tolist()) if v > 0]

    def _resend(self, grads: list[torch.Tensor | None], ranks: list[int]) -> None:
        """Some rank's gradients changed after backward sent them: every rank sends all
        buckets again from ``grads``, and stops overlapping."""
        if self.overlap:
            log.warning(
                "%s: rank(s) %s changed gradients after backward had sent them (clipping, "
                "unscaling or a second backward before step()); the update uses the gradients "
                "as step() sees them, all-reduced again, and overlap is off from now on",
                _OWNER, ranks,
            )  # fmt: skip
        self.overlap = False
        if self.buckets.tail is not None:
            self.buckets.tail.zero_()  # the flags were read: nothing to carry
        for i, g in enumerate(grads):
            self.buckets.fill(i, g)
            self._filled[self.buckets.bucket_of[i]].add(i)
        self._works = []
        for b in range(len(self.buckets)):
            self._send(b)
        self._wait()

    def _wait(self) -> None:
        for work in self._works:
            if work is not None:
                self._collective(self.group.wait, work)

    @property
    def _device(self) -> torch.device:
        """Where the group's collectives take the flags and counts."""
        return self.group.device

    def _lost(self, exc: BaseException) -> RuntimeError:
        """A lost peer with no loss allowed: the job's end, said plainly."""
        log.error("rank %d: the all-reduce failed: %s", self.rank, exc)
        return RuntimeError(
            f"{_OWNER}(transport='allreduce'): rank {self.rank}: a peer did not join the "
            f"all-reduce (dead, stuck, or it ran fewer steps: without a server every "
            f"worker runs the same number of steps; max_losses=K lets the others go on): "
            f"{str(exc).splitlines()[0]}"
        )

    # ------------------------------------------------------------------ losses and joins
    def _recover(self, exc: BaseException) -> None:
        """A member is lost: form the next generation with the live ones and heal it."""
        log.warning("rank %d: a member of the all-reduce is lost: %s", self.rank, exc)
        self._works = []
        # a collective given up on a silent member may still write into the buckets (gloo
        # cannot cancel it): the rounds from now on use new ones
        self.buckets = self._make_buckets()
        self._change(check_losses=True)

    def _grow(self) -> None:
        """A restarted rank asked to join (every member saw it in the flags): form the next
        generation with it, and heal it from this update's state."""
        self._change(check_losses=False)
