"""The pure state machine behind ``SyncReplicasOptimizer``: accumulators, staleness, tokens.

No processes, no I/O: the chief and the shards run it in their servers' handler calls (one at a
time), the tests drive it directly.

``GradientAggregator`` is TF's ``ConditionalAccumulator`` (dense variables) and
``SparseConditionalAccumulator`` (row-sparse variables) for a whole list of variables that share
one counter and one ``current_global_step``::

    push(worker, tag, grads):  accepted iff tag >= current_global_step (else silently dropped);
                               dense: sum += g; sparse: row_sum[rows] += rows, row_count[rows] += 1
                               (duplicate rows inside one gradient are summed first, counted once);
                               counter += 1
    take_average():            current_global_step += 1; dense: sum / counter (the number of
                               accepted gradients, as TF's take_grad); sparse: row_sum / row_count
                               for every touched row; counter := 0

TF keeps one accumulator per variable; with every push carrying the full gradient list they
advance in lockstep, so one shared counter is the same machine (TF's race where one variable
accepts a gradient its neighbour drops cannot happen here).  Beyond TF: a ``None`` gradient in a
dense slot counts as zeros (the push is one contribution), a variable that received ``None`` from
every accepted push averages to ``None`` (the wrapped optimizer skips it); per-worker counters of
accepted / dropped / rejected pushes; ``nonfinite`` policy for NaN/Inf gradients.

TF's token queue is :mod:`..tokens`; the non-finite check and policies are :mod:`..finite`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..common.finite import NONFINITE_POLICIES, all_finite
from ..common.preconditioning import weighted_sum_sq

__all__ = ["GradientAggregator"]

log = logging.getLogger(__name__)


class GradientAggregator:
    """Accumulate step-tagged gradient lists from workers; average once ``R`` are in."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        replicas_to_aggregate: int,
        nonfinite: str = "raise",
    ) -> None:
        if isinstance(replicas_to_aggregate, bool) or not isinstance(replicas_to_aggregate, int):
            raise ValueError(f"replicas_to_aggregate must be an int, got {replicas_to_aggregate!r}")
        if replicas_to_aggregate < 1:
            raise ValueError(
                "replicas_to_aggregate must be positive (TF: Argument num_required must be "
                f"positive), got {replicas_to_aggregate}"
            )
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.replicas_to_aggregate = replicas_to_aggregate
        self.nonfinite = nonfinite
        self.shapes = [tuple(p.shape) for p in params]
        self.dtypes = [p.dtype for p in params]
        self.kinds: list[str | None] = [None] * len(params)  # "dense"/"sparse", fixed on first use
        self.global_step = 0
        self.counter = 0
        self._sum = [torch.zeros(p.shape, dtype=p.dtype) for p in params]
        self._rows = [torch.zeros(p.shape[0] if p.dim() else 0, dtype=torch.int64) for p in params]
        self._seen = [False] * len(params)
        self.stats: dict[int, dict[str, int]] = {}
        # ``replicas_to_aggregate="auto"``: the noise terms of each update (:mod:`.replicas_policy`)
        self.measure_noise = False
        self._sum_sq: torch.Tensor | None = None  # sum over accepted pushes of |g_i|^2
        self.last_noise: tuple[float, float, int] | None = None  # of the last update
        self.last_verdict = ""  # of the last push: "accepted", "dropped" or "nonfinite"
        # the preconditioner the noise is weighted by (``Shard.measure``), read once per update
        self.noise_weights: Callable[[], list[torch.Tensor | None]] | None = None
        self._weights: list[torch.Tensor | None] | None = None

    # ------------------------------------------------------------------ validation
    def check(self, worker: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Raise ``ValueError`` if ``grads`` does not fit the variables; nothing changes."""
        if len(grads) != len(self.shapes):
            raise ValueError(
                f"worker {worker} pushed {len(grads)} gradients, the server holds "
                f"{len(self.shapes)} variables (parameter lists differ across workers)"
            )
        for i, g in enumerate(grads):
            if g is None:
                continue
            if tuple(g.shape) != self.shapes[i]:
                raise ValueError(
                    f"worker {worker}: gradient {i} has shape {tuple(g.shape)}, the server's "
                    f"variable {i} has shape {self.shapes[i]}"
                )
            kind = "sparse" if g.is_sparse else "dense"
            if g.is_sparse and (g.sparse_dim() != 1 or len(self.shapes[i]) < 1):
                raise ValueError(f"worker {worker}: sparse gradient {i} must be row-sparse")
            if self.kinds[i] not in (None, kind):
                raise ValueError(
                    f"worker {worker}: gradient {i} is {kind} but variable {i} accumulates "
                    f"{self.kinds[i]} gradients"
                )

    def _finite(self, grads: Sequence[torch.Tensor | None]) -> int | None:
        for i, g in enumerate(grads):
            if g is not None and not all_finite(g):
                return i
        return None

    def _count(self, worker: int, key: str) -> None:
        entry = self.stats.setdefault(worker, {"accepted": 0, "dropped": 0, "nonfinite": 0})
        entry[key] += 1

    # ------------------------------------------------------------------ the machine
    def push(self, worker: int, step_tag: int, grads: Sequence[torch.Tensor | None]) -> bool:
        """Offer one gradient list computed at ``step_tag``; True iff it was accumulated.

        Stale (``step_tag < global_step``) lists are dropped.  A non-finite list (checked
        first) raises
        ``FloatingPointError`` (``nonfinite="raise"``, nothing accumulated) or is dropped
        (``"drop"``) or accumulated like TF (``"apply"``).
        """
        self.check(worker, grads)
        bad = self._finite(grads) if self.nonfinite != "apply" else None
        if bad is not None:  # checked first: bad input is reported even when also stale
            self.last_verdict = "nonfinite"
            self._count(worker, "nonfinite")
            log.warning(
                "worker rank %d: non-finite gradient for variable %d %s %s (nonfinite=%r)",
                worker, bad, self.shapes[bad], "refused" if self.nonfinite == "raise" else
                "dropped", self.nonfinite,
            )  # fmt: skip
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"worker {worker}: non-finite gradient for variable {bad} "
                    f"{self.shapes[bad]}; it was not accumulated and nothing was applied"
                )
            return False
        if step_tag < self.global_step:
            self.last_verdict = "dropped"
            self._count(worker, "dropped")
            log.debug(
                "worker rank %d: stale gradient dropped (computed at step %d, accumulators at %d)",
                worker, step_tag, self.global_step,
            )  # fmt: skip
            return False
        sums, dense = [], []  # dense ones are added in one call: a server adds every push
        added: list[torch.Tensor | None] = [None] * len(grads)  # its |P g|^2, for "auto"
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is None:
                    continue
                self._seen[i] = True
                acc = self._sum[i]
                if g.device != acc.device:  # received tensors may sit in host memory
                    g = g.to(acc.device)
                if g.is_sparse:
                    self.kinds[i] = "sparse"
                    g = g.coalesce()
                    idx = g.indices()[0]
                    acc.index_add_(0, idx, g.values().to(self.dtypes[i]))
                    self._rows[i][idx] += 1
                    added[i] = g
                else:
                    self.kinds[i] = "dense"
                    sums.append(acc)
                    dense.append(g if g.dtype == acc.dtype else g.to(acc.dtype))
                    added[i] = dense[-1]
            if sums:
                torch._foreach_add_(sums, dense)
            if self.measure_noise:
                self._add_sum_sq(added)
        self.counter += 1
        self.last_verdict = "accepted"
        self._count(worker, "accepted")
        return True

    def _add_sum_sq(self, added: list[torch.Tensor | None]) -> None:
        """``|P g_i|^2`` of one accepted push (its dense gradients and sparse rows, as added;
        ``P`` the optimizer's preconditioner, :mod:`..common.preconditioning`), summed on the
        accumulators' device in float64 (read back once per update, by :meth:`take_average`)."""
        if self.noise_weights is not None and self._weights is None:
            self._weights = self.noise_weights()  # the optimizer's state is the update's own
        total = weighted_sum_sq(added, self._weights)
        self._sum_sq = total if self._sum_sq is None else self._sum_sq + total

    def count(self, worker: int, step_tag: int, verdict: str) -> bool:
        """A replicated server's copy of a push whose gradients stayed with its primary
        (:mod:`...hosting.standby`): counted as the primary's :meth:`push` decided
        (``verdict``: :attr:`last_verdict` there), nothing summed; True iff accepted.  The
        average it joins comes from the primary (:meth:`take_given`).  Raises RuntimeError
        where this copy's own staleness rule disagrees (the two have diverged: a bug)."""
        stale = step_tag < self.global_step
        if verdict not in ("accepted", "dropped", "nonfinite") or (
            verdict != "nonfinite" and stale != (verdict == "dropped")
        ):
            raise RuntimeError(
                f"worker {worker}: the primary's verdict {verdict!r} on a gradient of step "
                f"{step_tag} does not fit this copy's accumulators at step {self.global_step}"
            )
        self.last_verdict = verdict
        self._count(worker, verdict)
        if verdict != "accepted":
            return False
        self.counter += 1
        return True

    def withdraw(self, workers: Sequence[int]) -> None:
        """Forget the pending update's gradients (those of ``workers``, counted accepted):
        a standby that takes over holds their counts but not their sums (:meth:`count`), so
        their workers offer them again."""
        for worker in workers:
            self.stats[worker]["accepted"] -= 1
        self._reset()

    def drop_withheld(self, worker: int, step_tag: int) -> None:
        """A push whose gradients the worker withheld, having seen these accumulators past
        ``step_tag`` already: counted as a dropped stale gradient, as ``push`` would count it.
        Raises ``ValueError`` (nothing counted) if the accumulators are not past it, for the
        worker cannot have seen that; its gradients are not here to accumulate."""
        if step_tag >= self.global_step:
            raise ValueError(
                f"worker {worker} withheld its gradient computed at step {step_tag} as stale, "
                f"but the accumulators are at step {self.global_step}: the worker saw a later "
                "step than this server holds (were the servers' variables loaded from a "
                "checkpoint behind the workers' backs?)"
            )
        self._count(worker, "dropped")

    def ready(self) -> bool:
        return self.counter >= self.replicas_to_aggregate

    def take_average(self) -> list[torch.Tensor | None]:
        """The averages (TF ``take_grad``); advances ``global_step`` and resets."""
        if not self.ready():
            raise RuntimeError(
                f"take_average: {self.counter} of {self.replicas_to_aggregate} gradients present"
            )
        out: list[torch.Tensor | None] = []
        for i in range(len(self.shapes)):
            if not self._seen[i]:
                out.append(None)
            elif self.kinds[i] == "sparse":
                rows = self._rows[i].nonzero().reshape(-1)
                div = (
                    self._rows[i][rows]
                    .to(self.dtypes[i])
                    .reshape(-1, *[1] * (len(self.shapes[i]) - 1))
                )
                values = self._sum[i][rows] / div
                out.append(
                    torch.sparse_coo_tensor(rows.unsqueeze(0), values, self.shapes[i]).coalesce()
                )
            else:
                out.append(self._sum[i] / self.counter)
        if self.measure_noise:
            self.last_noise = self._noise_terms()
        self.global_step += 1
        self._reset()
        return out

    def take_given(self, noise: tuple[float, float, int] | None) -> None:
        """A replicated server's update whose averages came from its primary (:meth:`count`):
        advances ``global_step`` and resets as :meth:`take_average`; ``noise``: the
        primary's terms of that update."""
        if not self.ready():
            raise RuntimeError(
                f"take_given: {self.counter} of {self.replicas_to_aggregate} gradients present"
            )
        self.last_noise = None if noise is None else (float(noise[0]), float(noise[1]),
                                                      int(noise[2]))  # fmt: skip
        self.global_step += 1
        self._reset()

    def _noise_terms(self) -> tuple[float, float, int]:
        """``(sum_i |g_i|^2, |mean_i g_i|^2, k)`` of the update being taken."""
        k = self.counter
        used = [s if seen else None for s, seen in zip(self._sum, self._seen, strict=True)]
        mean_sq = float(weighted_sum_sq(used, self._weights)) / k**2
        sum_sq = 0.0 if self._sum_sq is None else float(self._sum_sq)
        return sum_sq, mean_sq, k

    def set_replicas(self, replicas: int) -> bool:
        """The number of gradients the pending update waits for (``"auto"``: chosen per
        update); True iff those already in are enough."""
        self.replicas_to_aggregate = int(replicas)
        return self.ready()

    def set_global_step(self, step: int) -> None:
        """TF's ``set_global_step`` (chief init): accumulated gradients are kept."""
        self.global_step = int(step)

    def _reset(self) -> None:
        self.counter = 0
        self._sum_sq = self._weights = None
        torch._foreach_zero_(self._sum)
        for r, kind in zip(self._rows, self.kinds, strict=True):
            if kind != "dense":  # dense variables never count rows
                r.zero_()
        self._seen = [False] * len(self.shapes)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "counter": self.counter,
            "kinds": list(self.kinds),
            "seen": list(self._seen),
            "sum": [s.clone() for s in self._sum],
            "rows": [r.clone() for r in self._rows],
            "stats": {int(w): dict(v) for w, v in self.stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shapes = [tuple(s.shape) for s in state["sum"]]
        if shapes != self.shapes:
            raise ValueError(f"aggregator state has shapes {shapes}, expected {self.shapes}")
        self.global_step = int(state["global_step"])
        self.counter = int(state["counter"])
        self.kinds = list(state["kinds"])
        self._seen = list(state["seen"])
        for dst, src in zip(
            self._sum + self._rows, list(state["sum"]) + list(state["rows"]), strict=True
        ):
            dst.copy_(src)
        self.stats = {int(w): dict(v) for w, v in state["stats"].items()}
