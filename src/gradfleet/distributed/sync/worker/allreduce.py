"""SyncReplicas without a server: R == N workers sum their gradients with all-reduces.

When every one of the N workers contributes to every update (no backup workers), the server's
state machine is the same on every rank, so each rank keeps a replica of it and the gradients
travel as DDP's do: in buckets, all-reduced, and -- with ``overlap`` -- while backward still
computes the earlier layers.

* **Buckets** (:class:`Buckets`): the parameters in reverse order (the order backward usually
  produces their gradients), one device and dtype per bucket, the first about 1 MiB and the
  others about 25 MiB (DDP's defaults: the first bucket leaves early, the others amortise a
  collective's fixed cost).  A parameter's slot holds its dense gradient, or its sparse
  gradient's rows summed into it.
* **Overlap**: a post-accumulate-grad hook copies each gradient into its slot; a bucket whose
  slots are all in is all-reduced at once, asynchronously, buckets strictly in order so that
  every rank issues the same collectives in the same order.  ``step()`` fills and sends the
  buckets backward did not complete (a parameter that got no gradient), then one small
  all-reduce of flags per parameter and rank: which ranks had a gradient (dense or sparse), a
  non-finite one, or **changed a gradient after it was sent** (clipping, ``GradScaler``
  unscaling, a second backward: the gradient's version counter moved, or it is another
  tensor).  If any rank changed one, every rank sends all buckets again from the gradients as
  ``step()`` sees them and overlap is off from then on (logged once): the update is always
  made from the gradients as they stand at ``step()``, as TF's ``apply_gradients`` makes it,
  never from a copy taken earlier.
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
import math
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ...common.apply import apply_gradients
from ...transport import LINK_ERRORS, gloo_link
from ...transport.all_reduce import GradientMean, densify_
from ...transport.world_group import WorldGroup
from ..common.job import Job
from ..common.outcome import Outcome
from ..common.tokens import TokenQueue
from .live_state import LiveState

__all__ = ["AllReduceExchange", "Buckets"]

log = logging.getLogger(__name__)

_OWNER = "SyncReplicasOptimizer"
FIRST_BUCKET_BYTES = 1 << 20  # DDP's defaults
BUCKET_BYTES = 25 << 20


class Buckets:
    """Parameters laid out in flat buffers for all-reduce (module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        first_bytes: int = FIRST_BUCKET_BYTES,
        bytes_each: int = BUCKET_BYTES,
    ) -> None:
        self.members: list[list[int]] = []
        open_: dict[tuple[torch.device, torch.dtype], int] = {}  # key -> bucket being filled
        sizes: list[int] = []
        for i in reversed(range(len(params))):
            p = params[i]
            key = (p.device, p.dtype)
            b = open_.get(key)
            if b is None:
                b = open_[key] = len(self.members)
                self.members.append([])
                sizes.append(0)
            self.members[b].append(i)
            sizes[b] += p.numel() * p.element_size()
            if sizes[b] >= (first_bytes if b == 0 else bytes_each):
                del open_[key]
        self.flat = [
            torch.zeros(
                sum(params[i].numel() for i in idx),
                dtype=params[idx[0]].dtype,
                device=params[idx[0]].device,
            )
            for idx in self.members
        ]
        self.bucket_of: dict[int, int] = {}
        self.slot: dict[int, torch.Tensor] = {}  # parameter index -> view of its bucket
        for b, idx in enumerate(self.members):
            offset = 0
            for i in idx:
                n = params[i].numel()
                self.slot[i] = self.flat[b][offset : offset + n].view(params[i].shape)
                self.bucket_of[i] = b
                offset += n

    def __len__(self) -> int:
        return len(self.members)

    def fill(self, i: int, g: torch.Tensor | None) -> None:
        """Parameter ``i``'s slot := its gradient (None: zeros; sparse: its rows summed in)."""
        densify_(self.slot[i], g)


def _any_nonfinite(grads: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """1.0 if any gradient holds a NaN or an infinity, else 0.0, computed where the gradients
    are: one max-norm per tensor (NaN and infinities survive it), no host round trip."""
    values = []
    for g in grads:
        if g is None:
            continue
        v = g._values() if g.is_sparse else g
        if v.is_complex():
            v = torch.view_as_real(v)
        if v.is_floating_point() and v.numel():
            values.append(v)
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(values, math.inf)
    top = torch.stack([m.to(device=device, dtype=torch.float64) for m in norms])
    return (~torch.isfinite(top).all()).to(torch.float64)


def _mark(g: torch.Tensor | None) -> tuple[int, int] | None:
    """What identifies a gradient's contents: its storage and its version counter (an
    in-place change moves the counter; a ``detach()``ed view shares both)."""
    if g is None:
        return None
    data = g._values() if g.is_sparse else g
    return data.data_ptr(), g._version


class AllReduceExchange:
    """R == N SyncReplicas with all-reduces and a replica of the server's state on every rank
    (module docstring)."""

    def __init__(
        self, opt: torch.optim.Optimizer, job: Job, overlap: bool = True, group: Any = None
    ) -> None:
        """``group``: the members' collectives (default: the job's process group, every rank;
        an :class:`~...transport.elastic_group.ElasticGroup` where losses are allowed -- one
        that is joining makes this rank heal from a live member before it returns)."""
        N, tokens, num_tokens, nonfinite = job.N, job.tokens, job.initial_tokens, job.nonfinite
        if tokens == "shared" and num_tokens % N:
            raise ValueError(
                f"{_OWNER}: transport='allreduce' with tokens='shared' needs num_tokens to be a "
                f"multiple of total_num_replicas ({N}), got {num_tokens}"
            )
        if nonfinite == "drop":
            raise ValueError(
                f"{_OWNER}: nonfinite='drop' needs a server (transport='server'): without one "
                "a dropped gradient would leave its update short"
            )
        if job.max_losses and tokens != "distinct":
            raise ValueError(
                f"{_OWNER}: max_losses needs tokens='distinct' (the shared token queue counts "
                f"N={N} tokens per update, and the members change)"
            )
        self.opt, self.N, self.nonfinite, self.rule = opt, N, nonfinite, tokens
        self.max_losses = job.max_losses
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.group = WorldGroup() if group is None else group
        joining = self.group.generation > 0 or self.group.size != N
        self.world, self.rank = self.group.size, self.group.rank
        if self.world != N and not joining:
            raise ValueError(
                f"{_OWNER}: total_num_replicas={N} must equal the world size {self.world} "
                "without a server (name server_ranks for dedicated servers)"
            )
        if not joining:
            self._check_layout()
        self.buckets = Buckets(self.params)
        self.tokens = TokenQueue()
        self.global_step = int(job.global_step)  # a restored step: the tokens carry it
        if tokens == "shared":
            self.tokens.put(self.global_step, num_tokens)
        self.local_step = self.global_step
        self.last_step = job.last_step
        self.ema, self.average_indices = job.ema, list(job.averaged)
        self.stats = {r: {"accepted": 0, "dropped": 0, "nonfinite": 0} for r in range(N)}
        self.bytes_sent = 0
        self.sent_in_backward = 0  # buckets a gradient hook sent (overlap at work)
        self.overlap = overlap and self.world > 1
        self._hooks: list[Any] = []
        self._sent: dict[int, tuple[int, int] | None] = {}  # parameter -> what was sent
        self._works: list[Any] = []  # the buckets' all-reduces this round, in order
        self._filled: list[set[int]] = [set() for _ in range(len(self.buckets))]
        self._waiting_for: list[set[int]] = []
        self._broken: BaseException | None = None  # a link error a gradient hook met
        self.losses: list[dict[str, Any]] = []  # each change of members: when, who, how
        self._replicas: list[int] = []  # the members of each update made since the start
        self.live = LiveState(self.params, opt, self._books, self._load_books, _OWNER)
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
        else:
            self._broadcast_parameters()
        self.start_step = self.global_step
        self.local_step = self.global_step
        if self.overlap:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._hook, i)))
        self._new_round()

    # ------------------------------------------------------------------ set-up
    def _check_layout(self) -> None:
        mine = [(list(p.shape), str(p.dtype)) for p in self.params]
        if self.world == 1 or not dist.is_initialized():
            return
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        for r, theirs in enumerate(every):
            if theirs != mine:
                raise ValueError(
                    f"{_OWNER}: rank {r} has parameters {theirs}, rank "
                    f"{self.rank} has {mine}; every worker must build the same model"
                )

    def _broadcast_parameters(self) -> None:
        """Every rank starts from rank 0's values (the server path's workers read the chief's)."""
        if self.world == 1:
            return
        with torch.no_grad():
            for b, idx in enumerate(self.buckets.members):
                for i in idx:
                    self.buckets.slot[i].copy_(self.params[i])
                self._collective(self.group.broadcast, self.buckets.flat[b], 0)
                for i in idx:
                    self.params[i].copy_(self.buckets.slot[i])

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

    def _hook(self, i: int, param: torch.Tensor) -> None:
        b = self.buckets.bucket_of[i]
        if not self._armed() or b < len(self._works) or param.grad is None:
            return  # bucket already sent: step() sees the changed gradient and resends
        if self._broken is not None:
            return  # the group is broken: step() re-forms it and sends everything
        self.buckets.fill(i, param.grad)
        self._sent[i] = _mark(param.grad)
        self._filled[b].add(i)
        self._waiting_for[b].discard(i)
        try:
            while len(self._works) < len(self.buckets) and not self._waiting_for[len(self._works)]:
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
        work = self._collective(self.group.all_reduce, self.buckets.flat[b], True)
        self._works.append(work)
        flat = self.buckets.flat[b]
        self.bytes_sent += flat.numel() * flat.element_size()

    # ------------------------------------------------------------------ the round
    def _released(self) -> bool:
        return self.last_step is not None and self.global_step >= self.last_step

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
            return Outcome(*self._round(grads))
        finally:
            self._new_round()

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
        pairs = [(g, p) for g, p in zip(averages, self.params, strict=True) if g is not None]
        if pairs:
            apply_gradients(self.opt, pairs)
        self.global_step += 1
        if self.rule == "shared":
            self.tokens.put(self.global_step, self.N)
        if self.ema is not None:
            chosen = self.average_indices or range(len(self.params))
            self.ema.apply({i: self.params[i] for i in chosen}, num_updates=self.global_step)
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
        n, me, size = len(grads), self.group.index, self.world
        changed = False
        for i, g in enumerate(grads):
            b = self.buckets.bucket_of[i]
            if b < len(self._works):  # sent during backward: is it still what step() sees?
                changed |= _mark(g) != self._sent[i]
            else:
                self.buckets.fill(i, g)
                self._filled[b].add(i)
        # the buckets backward did not complete, in order, then the flags
        while len(self._works) < len(self.buckets):
            self._send(len(self._works))
        reduce = partial(self._collective, self.group.all_reduce)
        mean = GradientMean(self.params, size, reduce, self._device, _OWNER)
        # then the nonfinite and changed flags, and one for joiners
        flags = mean.flags(grads, extra=2 * size + 1)
        if self.nonfinite == "raise":  # a tensor op: no host synchronisation per gradient
            flags[2 * n + me] = _any_nonfinite(grads, flags.device)
        flags[2 * n + size + me] = float(changed)
        flags[2 * n + 2 * size] = float(self.group.joiners_waiting)
        self._wait()
        self._collective(self.group.all_reduce, flags)
        flags = flags.cpu()
        members = self.group.members
        bad = [members[r] for r in range(size) if flags[2 * n + r] > 0]
        if bad:
            raise FloatingPointError(
                f"{_OWNER}: non-finite gradient from rank(s) {bad}; it was not applied "
                "(nothing changed)"
            )
        resend = [members[r] for r in range(size) if flags[2 * n + size + r] > 0]
        if resend:
            self._resend(grads, resend)
        averages = mean.means(grads, [self.buckets.slot[i] for i in range(n)], flags)
        return averages, bool(flags[2 * n + 2 * size] > 0)

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

    def _collective(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the members' group (nothing to do alone).  A lost member: with
        ``max_losses`` its error passes as itself (one of ``LINK_ERRORS``: the round re-forms
        the group), else the job ends with an error that says so; a bug passes as itself."""
        if self.world == 1:
            return None
        try:
            with gloo_link("a peer of the all-reduce", getattr(fn, "__name__", "collective")):
                return fn(*args)
        except LINK_ERRORS as exc:  # gloo's (named by gloo_link) and NCCL's: a peer is missing
            if self.max_losses:
                raise
            raise self._lost(exc) from None

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
        self.buckets = Buckets(self.params)
        self._change(check_losses=True)

    def _grow(self) -> None:
        """A restarted rank asked to join (every member saw it in the flags): form the next
        generation with it, and heal it from this update's state."""
        self._change(check_losses=False)

    def _change(self, check_losses: bool) -> None:
        """Form the next generation and heal it; a member lost meanwhile (during the heal's
        collectives) makes the one after it."""
        started = time.monotonic()
        gone: list[int] = []
        came: list[int] = []
        while True:
            lost_now, came_now = self.group.reform()
            gone += [r for r in lost_now if r not in gone]
            came = [r for r in dict.fromkeys(came + came_now) if r in self.group.members]
            self.world = self.group.size
            missing = [r for r in range(self.N) if r not in self.group.members]
            if (check_losses or lost_now) and len(missing) > self.max_losses:
                raise RuntimeError(
                    f"{_OWNER}(transport='allreduce'): rank {self.rank}: ranks {missing} are "
                    f"gone, more than max_losses={self.max_losses}"
                )
            try:
                self._heal()
                break
            except LINK_ERRORS as exc:
                log.warning("rank %d: a member was lost while healing: %s", self.rank, exc)
        if gone:
            self._note("lost", gone, started)
        if came:
            self._note("joined", came, started)

    def _note(self, what: str, ranks: list[int], started: float) -> None:
        took = time.monotonic() - started
        self.losses.append(
            {"event": what, "ranks": ranks, "members": list(self.group.members),
             "global_step": self.global_step, "seconds": took}
        )  # fmt: skip
        log.warning(
            "rank %d: rank(s) %s %s; members now %s at global step %d (%.2fs)",
            self.rank, ranks, what, self.group.members, self.global_step, took,
        )  # fmt: skip

    def _heal(self) -> None:
        """Every member's state := that of the first member holding the newest step."""
        self.global_step = self.live.heal(self.group, self.global_step)

    def _books(self) -> dict[str, Any]:
        return {"exchange": self.state_dict(), "replicas": list(self._replicas)}

    def _load_books(self, books: dict[str, Any]) -> None:
        self.load_state_dict(books["exchange"])
        self._replicas = list(books["replicas"])

    # ------------------------------------------------------------------ the exchange's API
    # (:class:`..exchange.Exchange`: what SyncReplicasOptimizer asks of any exchange)
    server_addresses: list[str] = []  # no server: nothing to rejoin through
    server_address = None
    is_chief = False
    dedicated: list[int] = []
    withheld_pushes = 0
    streaming = False  # the parameters are updated in place: nothing to read
    reads_pending = False

    def check_own_gradients(self) -> None:
        """``apply_gradients`` brings gradients of its own: a round backward's hooks
        started is noticed as changed gradients and sent again, so nothing to refuse."""

    def stream_reads(self, model: torch.nn.Module) -> None:
        raise ValueError(
            f"{_OWNER}.stream_reads: needs transport='server' with several shards: the "
            "all-reduce exchange updates the parameters in place, there is nothing to read"
        )

    def wait_reads(self) -> None:
        """Nothing is ever left to read."""

    def replicas_history(self) -> list[int]:
        """The members whose gradients made each update since this rank started (all N,
        unless losses are allowed and some were lost)."""
        return list(self._replicas)

    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]:
        if shard != 0:
            raise ValueError(f"{_OWNER}.worker_counters: no shard {shard!r}")
        return self.stats

    def averaged_variables(self) -> list[torch.Tensor | None]:
        if self.ema is None:
            raise RuntimeError(f"{_OWNER}: no variable_averages here")
        return [self.ema.shadows.get(i) for i in range(len(self.params))]

    def worker_silence(self) -> dict[int, float]:
        raise RuntimeError(
            f"{_OWNER}.worker_silence: this job has no server (transport='allreduce': R == N "
            "workers all-reduce); name server_rank= or server_ranks= to have one"
        )

    def forget_workers(self, ranks: Sequence[int]) -> None:
        """No server to tell."""

    def state(self) -> dict[str, Any]:
        return {"server": None, "allreduce": self.state_dict()}

    def check_state(self, counters: dict[str, Any]) -> None:
        if counters.get("allreduce") is None:
            raise ValueError(
                f"{_OWNER}.load_state_dict: the checkpoint is of an exchange with servers, "
                "this optimizer all-reduces (transport='allreduce')"
            )

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["allreduce"])

    def applied_state(self) -> tuple[Any, dict[int, Any], int]:
        """This rank's own optimizer: its parameters are the variables (an empty map)."""
        return self.opt, {}, int(self.global_step)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "tokens": self.tokens.state(),
            "stats": {int(k): dict(v) for k, v in self.stats.items()},
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.tokens.load(state["tokens"] if self.rule == "shared" else [])
        self.stats = {int(k): dict(v) for k, v in state["stats"].items()}
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
