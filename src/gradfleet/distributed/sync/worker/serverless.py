"""What every exchange without a server shares: a replica of the server's state on every rank.

Without a server, each rank holds what the chief would: the variables (the parameters
themselves), the wrapped optimizer's slots, ``global_step``, the token queue, the counters and
``variable_averages``.  Every rank applies the same updates in the same order, so the replicas
stay bit-identical.  :class:`ServerlessExchange` keeps these books, starts every rank from
rank 0's parameters, and answers the questions the optimizer asks of any exchange
(:class:`..exchange.Exchange`); the two exchanges built on it differ in who sends gradients
to an update:

* :class:`.allreduce.AllReduceExchange`: all N workers, every update (R == N);
* :class:`.first_arrivals.FirstArrivalsExchange`: the first R of N (backup workers).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...common.apply import apply_gradients
from ...transport import LINK_ERRORS, gloo_link
from ...transport.world_group import WorldGroup
from ..common.job import Job
from ..common.tokens import TokenQueue
from .buckets import Buckets
from .live_state import LiveState

__all__ = ["ServerlessExchange", "any_nonfinite", "nonfinite_screen"]

_OWNER = "SyncReplicasOptimizer"

log = logging.getLogger(__name__)


def _floating(grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients' values as real floating tensors (sparse: their values; complex: viewed
    as real), the empty ones left out."""
    values = []
    for g in grads:
        if g is None:
            continue
        v = g._values() if g.is_sparse else g
        if v.is_complex():
            v = torch.view_as_real(v)
        if v.is_floating_point() and v.numel():
            values.append(v)
    return values


def _flag(norms: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    top = torch.stack([m.to(device=device, dtype=torch.float64) for m in norms])
    return (~torch.isfinite(top).all()).to(torch.float64)


def nonfinite_screen(grads: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """1.0 if a gradient *may* hold a NaN or an infinity, else 0.0 (then none does), computed
    where the gradients are, no host round trip: one Euclidean norm per tensor (accumulated in
    float32 for 16-bit tensors).  A NaN or an infinity makes its norm non-finite; so can finite
    elements whose squares overflow (above about 1e19 in float32), which
    :func:`any_nonfinite` tells apart.  Why not that exact check every step: torch's
    infinity-norm is a slow kernel on the CPU (3.1 ms against 0.15 ms for 1M float32 elements
    on one core), a tenth of a small model's step."""
    values = _floating(grads)
    norms: list[torch.Tensor] = []
    half = [v for v in values if v.element_size() < 4]  # float16, bfloat16
    full = [v for v in values if v.element_size() >= 4]
    if full:
        norms += torch._foreach_norm(full, 2)
    if half:
        norms += torch._foreach_norm(half, 2, dtype=torch.float32)
    return _flag(norms, device)


def any_nonfinite(grads: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """1.0 if any gradient holds a NaN or an infinity, else 0.0, computed where the gradients
    are: one max-norm per tensor (NaN and infinities survive it), no host round trip.  Exact,
    and slow on the CPU: screen with :func:`nonfinite_screen` first."""
    values = _floating(grads)
    return _flag(torch._foreach_norm(values, math.inf) if values else [], device)


class ServerlessExchange:
    """The books and questions of an exchange whose every rank keeps the server's state
    (module docstring).  ``group``: the members' collectives (default: the job's process
    group); ``joining``: this rank restarts one of a running job (its state comes later)."""

    max_losses = 0

    def __init__(
        self, opt: torch.optim.Optimizer, job: Job, group: Any = None, joining: bool = False
    ) -> None:
        if job.nonfinite == "drop":
            raise ValueError(
                f"{_OWNER}: nonfinite='drop' needs a server (transport='server'): without one "
                "a dropped gradient would leave its update short"
            )
        self.opt, self.N, self.nonfinite, self.rule = opt, job.N, job.nonfinite, job.tokens
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.group = WorldGroup() if group is None else group
        self.world, self.rank = self.group.size, self.group.rank
        if self.world != self.N and not joining:
            raise ValueError(
                f"{_OWNER}: total_num_replicas={self.N} must equal the world size "
                f"{self.world} without a server (name server_ranks for dedicated servers)"
            )
        if not joining:
            self._check_layout()
        self.buckets = self._make_buckets()
        self.tokens = TokenQueue()
        self.global_step = int(job.global_step)  # a restored step: the tokens carry it
        if self.rule == "shared":
            self.tokens.put(self.global_step, job.initial_tokens)
        self.local_step = self.start_step = self.global_step
        self.last_step = job.last_step
        self.ema, self.average_indices = job.ema, list(job.averaged)
        self.stats = {r: {"accepted": 0, "dropped": 0, "nonfinite": 0} for r in range(self.N)}
        self.bytes_sent = 0
        self._replicas: list[int] = []  # the gradients in each update made since the start
        self.losses: list[dict[str, Any]] = []  # each change of members: when, who, how
        self.live = LiveState(self.params, opt, self._books, self._load_books, _OWNER)

    # ------------------------------------------------------------------ losses and joins
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

    def _make_buckets(self) -> Buckets:
        """The gradients' buffers, new at the start and after a loss (an abandoned collective
        may still write into the old ones)."""
        return Buckets(self.params)

    def _heal(self) -> None:
        """Every member's state := that of the first member holding the newest step."""
        self.global_step = self.live.heal(self.group, self.global_step)

    def _books(self) -> dict[str, Any]:
        return {"exchange": self.state_dict(), "replicas": list(self._replicas)}

    def _load_books(self, books: dict[str, Any]) -> None:
        self.load_state_dict(books["exchange"])
        self._replicas = list(books["replicas"])

    def start(self) -> None:
        """Every rank from rank 0's parameters (the server path's workers read the chief's)."""
        self._broadcast_parameters()
        self.start_step = self.local_step = self.global_step

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
        if self.world == 1:
            return
        with torch.no_grad():
            for b, idx in enumerate(self.buckets.members):
                for i in idx:
                    self.buckets.slot[i].copy_(self.params[i])
                self._collective(self.group.broadcast, self.buckets.flat[b], 0)
                for i in idx:
                    self.params[i].copy_(self.buckets.slot[i])

    def _collective(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with the members (nothing to do alone).  A lost member: with
        ``max_losses`` its error passes as itself (one of ``LINK_ERRORS``: the round re-forms
        the group), else the job ends with an error that says so (:meth:`_lost`); a bug passes
        as itself."""
        if self.world == 1:
            return None
        try:
            with gloo_link("a peer of the all-reduce", getattr(fn, "__name__", "collective")):
                return fn(*args)
        except LINK_ERRORS as exc:  # gloo's (named by gloo_link) and NCCL's: a peer is missing
            if self.max_losses:
                raise
            raise self._lost(exc) from None

    def _lost(self, exc: BaseException) -> RuntimeError:
        raise NotImplementedError  # each exchange says what a lost peer means to it

    # ------------------------------------------------------------------ the update
    def _released(self) -> bool:
        return self.last_step is not None and self.global_step >= self.last_step

    def apply_update(self, averages: Sequence[torch.Tensor | None]) -> None:
        """Apply the mean gradients (None: the parameter had none) as the server would:
        the wrapped optimizer, ``global_step`` + 1, then the moving averages."""
        pairs = [(g, p) for g, p in zip(averages, self.params, strict=True) if g is not None]
        if pairs:
            apply_gradients(self.opt, pairs)
        self.global_step += 1
        if self.ema is not None:
            chosen = self.average_indices or range(len(self.params))
            self.ema.apply({i: self.params[i] for i in chosen}, num_updates=self.global_step)

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
        """The gradients that made each update since this rank started (R, or the members
        present where losses are allowed and some were lost)."""
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
            f"{_OWNER}.worker_silence: this job has no server (transport='allreduce': the "
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
                "this optimizer has none (transport='allreduce': the default where no server "
                "is named, also with backup workers on the CPU); pass transport='server' to "
                "resume it as it ran"
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
