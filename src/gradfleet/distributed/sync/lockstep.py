"""``SyncReplicasOptimizer(transport="allreduce")``: R == N without a server.

When every one of the N workers must contribute (no backups) and all run in lockstep, the
server's state machine is the same on every rank, so each rank keeps a replica of it:

* the token queue (``num_tokens`` initial tokens, N per update) and every worker's
  ``local_step``: with ``num_tokens`` a multiple of N the workers of a round all hold the same
  token, so one integer describes them;
* a round whose tag is stale (``local_step < global_step``: TF's wasted round after start-up)
  is dropped by everyone without communication;
* a fresh round sums the gradients with one all-reduce (sparse gradients as dense row sums plus
  per-row counts), divides dense ones by N and sparse rows by their counts, and applies them
  with each rank's own copy of the wrapped optimizer (identical on every rank), then
  ``global_step += 1`` and N tokens of the new step.

This reproduces the server path's numbers when the workers run in lockstep, without its
straggler tolerance: every round waits for the slowest rank.  A dead rank makes the all-reduce
fail after the process group's timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..apply import apply_gradients
from ..flat import flatten, unflatten_
from ..moving_average import ExponentialMovingAverage
from .aggregator import TokenQueue, all_finite

__all__ = ["AllReduceSync"]

log = logging.getLogger(__name__)


class AllReduceSync:
    """Replicated SyncReplicas state for R == N (see module docstring)."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        replicas_to_aggregate: int,
        total_num_replicas: int,
        num_tokens: int,
        nonfinite: str,
        ema: ExponentialMovingAverage | None,
        average_indices: Sequence[int],
        global_step: int = 0,
    ) -> None:
        N = total_num_replicas
        if replicas_to_aggregate != N:
            raise ValueError(
                "SyncReplicasOptimizer: transport='allreduce' needs "
                f"replicas_to_aggregate == total_num_replicas, got {replicas_to_aggregate} vs {N}"
            )
        if num_tokens % N:
            raise ValueError(
                "SyncReplicasOptimizer: transport='allreduce' needs num_tokens to be a "
                f"multiple of total_num_replicas ({N}), got {num_tokens}"
            )
        if nonfinite == "drop":
            raise ValueError("SyncReplicasOptimizer: nonfinite='drop' needs transport='server'")
        self.opt, self.N, self.nonfinite = opt, N, nonfinite
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.world != N:
            raise ValueError(
                f"SyncReplicasOptimizer: total_num_replicas={N} must equal the world size "
                f"{self.world}"
            )
        self._check_layout()
        self.tokens = TokenQueue()
        self.global_step = int(global_step)  # a restored step: the tokens carry it
        self.tokens.put(self.global_step, num_tokens)
        self.ema, self.average_indices = ema, list(average_indices)
        self.stats = {r: {"accepted": 0, "dropped": 0, "nonfinite": 0} for r in range(N)}
        self.bytes_sent = 0

    def _check_layout(self) -> None:
        mine = [(list(p.shape), str(p.dtype)) for p in self.params]
        if self.world == 1:
            return
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        for r, theirs in enumerate(every):
            if theirs != mine:
                raise ValueError(
                    f"SyncReplicasOptimizer: rank {r} has parameters {theirs}, rank "
                    f"{self.rank} has {mine}; every worker must build the same model"
                )

    def _take_tokens(self) -> int:
        values = [self.tokens.get() for _ in range(self.N)]
        if values[0] is None:
            raise RuntimeError("SyncReplicasOptimizer: no token left (num_tokens too small)")
        return int(values[self.rank])  # type: ignore[arg-type]

    def step(self, local_step: int, grads: list[torch.Tensor | None]) -> tuple[bool, int, int]:
        """One lockstep round; returns (accepted, new local_step, global_step)."""
        if local_step < self.global_step:  # every rank holds the same stale tag
            log.debug(
                "rank %d: stale round dropped on every rank (tag %d, global step %d)",
                self.rank, local_step, self.global_step,
            )  # fmt: skip
            for s in self.stats.values():
                s["dropped"] += 1
            return False, self._take_tokens(), self.global_step
        averages = self._reduce(grads)
        pairs = [(g, p) for g, p in zip(averages, self.params, strict=True) if g is not None]
        if pairs:
            apply_gradients(self.opt, pairs)
        self.global_step += 1
        self.tokens.put(self.global_step, self.N)
        if self.ema is not None:
            chosen = self.average_indices or range(len(self.params))
            self.ema.apply({i: self.params[i] for i in chosen}, num_updates=self.global_step)
        for s in self.stats.values():
            s["accepted"] += 1
        return True, self._take_tokens(), self.global_step

    def _reduce(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Sum gradients (dense, sparse as row sums + row counts) over ranks; average."""
        n = len(grads)
        flags = torch.zeros(2 * n + self.world, dtype=torch.float64)  # dense count, sparse count
        bufs = []
        for i, (g, p) in enumerate(zip(grads, self.params, strict=True)):
            dense = torch.zeros(p.shape, dtype=p.dtype)
            rows = torch.zeros(p.shape[0] if p.dim() else 0, dtype=p.dtype)
            if g is not None and g.is_sparse:
                flags[n + i] = 1.0
                g = g.coalesce()
                dense.index_add_(0, g.indices()[0], g.values().to(p.dtype))
                rows[g.indices()[0]] = 1
            elif g is not None:
                flags[i] = 1.0
                dense.copy_(g)
            bufs += [dense, rows]
        if self.nonfinite == "raise" and not all(all_finite(b) for b in bufs):
            flags[2 * n + self.rank] = 1.0
        if self.world > 1:
            dtype = bufs[0].dtype if len({b.dtype for b in bufs}) == 1 else torch.float64
            flat = flatten(bufs, dtype)
            self._allreduce(flat, flags)
            unflatten_(flat, bufs)
        bad = [r for r in range(self.world) if flags[2 * n + r] > 0]
        if bad:
            raise FloatingPointError(
                f"SyncReplicasOptimizer: non-finite gradient from rank(s) "
                f"{bad}; it was not applied (nothing changed)"
            )
        mixed = [i for i in range(n) if flags[i] > 0 and flags[n + i] > 0]
        if mixed:
            raise ValueError(
                f"SyncReplicasOptimizer: variables {mixed} got dense gradients on "
                "some ranks and sparse ones on others"
            )
        return [
            self._average(p, bufs[2 * i], bufs[2 * i + 1], flags[i], flags[n + i])
            for i, p in enumerate(self.params)
        ]

    def _average(self, p, dense, rows, n_dense, n_sparse) -> torch.Tensor | None:
        if n_dense == 0 and n_sparse == 0:
            return None
        if n_sparse == 0:  # None counts as zeros: divide by the N accepted gradients
            return dense / self.N
        idx = rows.nonzero().reshape(-1)
        div = rows[idx].reshape(-1, *[1] * (p.dim() - 1))
        return torch.sparse_coo_tensor(idx.unsqueeze(0), dense[idx] / div, p.shape).coalesce()

    def _allreduce(self, flat: torch.Tensor, flags: torch.Tensor) -> None:
        try:
            dist.all_reduce(flags)
            dist.all_reduce(flat)
        except Exception as exc:
            log.error("rank %d: the lock-step all-reduce failed: %s", self.rank, exc)
            raise RuntimeError(
                f"SyncReplicasOptimizer(transport='allreduce'): rank {self.rank}: a peer did not "
                f"join the all-reduce (dead or stuck): {str(exc).splitlines()[0]}"
            ) from None
        self.bytes_sent += flat.numel() * flat.element_size() + flags.numel() * 8

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "tokens": self.tokens.state(),
            "stats": {int(k): dict(v) for k, v in self.stats.items()},
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.tokens.load(state["tokens"])
        self.stats = {int(k): dict(v) for k, v in state["stats"].items()}
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
