"""How many gradients each update waits for: ``replicas_to_aggregate="auto"`` and its measurements.

Backup workers (Chen et al. 2016) make an update from the first R of N gradients; the right R
depends on how fast each worker is *now* and on how much one more gradient is worth.  Like
Dynamic Backup Workers (Xu, Neglia and Sebastianelli 2020, arXiv 2004.14696), the chief chooses
R again before every update, from what it has measured:

* **How long each worker's round takes.**  :class:`Measurements` keeps, per worker, the time
  from the token it was served to its gradient's arrival at the chief (its *round*: read,
  forward, backward, push), the median of the last :data:`ROUNDS_KEPT`.  A worker already late
  on its current round (``now - s > d``, token served at ``s``) is expected to need as long
  again as it has taken so far (``2 (now - s)``): a slowdown counts before its round is ever
  measured.  With these rounds, an update of R gradients takes ``T(R)``, the R-th shortest.
* **What R gradients are worth** (McCandlish et al. 2018, "An Empirical Model of Large-Batch
  Training"): with the best step size, an update averaging R gradients makes
  ``R / (R + rho)`` of the progress of an exact gradient, where ``rho = tr(Sigma) / |G|^2`` is
  the noise scale of one worker's gradient (``Sigma`` its covariance, ``G`` the true gradient).
  From the k gradients ``g_i`` of an update with mean ``m`` (:meth:`Measurements.noise`, summed
  over every shard's variables)::

      tr(Sigma) ~ k/(k-1) * (mean_i |g_i|^2 - |m|^2)      |G|^2 ~ |m|^2 - tr(Sigma)/k

  both unbiased, each smoothed over updates (weight :data:`NOISE_WEIGHT` on the newest) before
  their ratio is taken, once :data:`NOISE_UPDATES` updates were measured (one update's
  estimate is too noisy to act on).  An update of one gradient tells nothing about the noise.
  For an adaptive optimizer the norms are taken in its preconditioner's metric
  (:mod:`.preconditioning`): the noise its steps feel.
* **What an R really costs.**  ``T(R)`` is the steady cost of an update, as if every worker
  started its round together.  A worker left out of the last updates is out of phase (its next
  gradient will be stale, the one after joins); where stragglers move, that costs an R as much
  as its rounds.  Charging the model's guess of it to the choice would keep a recovered worker
  out for good, so it is measured instead: an update's *lag* (:meth:`Measurements.lag`) is the
  seconds since the update before over the ``T(R)`` it was chosen by (or the R-th of the
  workers' latest rounds, if a slowdown came after the choice), at least 1, smoothed per R
  (weight :data:`LAG_WEIGHT`).  Its excess over 1 halves every :data:`LAG_HALF_LIFE` updates
  in which that R is not made, so an R that was costly once is tried again: the only
  exploration, bounded by that half-life.

:class:`AutoReplicas` chooses, among 2 <= R <= live workers (1 only when one worker is live:
an update of one gradient measures no noise, so a choice of R = 1 could never be revisited),
the R that maximises progress per second, ``(R / (R + rho)) / (T(R) lag(R))`` (ties: the
larger R), and keeps the R it chose last unless another promises :data:`SWITCH_MARGIN` more.
It starts from R = live workers until every live worker's round is measured, then takes the
most gradients per second (``rho`` infinite) until the noise is measured.  Assumptions, stated
in the docs: gradients of one update are independent samples of the same distribution; the
progress model holds for the optimizer (exact for SGD at its best step size, a heuristic at
another step size and for adaptive ones); the next rounds look like the last few.

A policy is any object with ``choose(view) -> int`` (``view``: a :class:`Decision`), plus
``state_dict()``/``load_state_dict()`` for checkpoints.  Pure: no clock and no I/O; the chief
passes the times.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AutoReplicas",
    "Decision",
    "Measurements",
    "ReplicasPolicy",
    "NOISE_UPDATES",
    "NOISE_WEIGHT",
    "ROUNDS_KEPT",
    "SWITCH_MARGIN",
    "LAG_WEIGHT",
    "LAG_HALF_LIFE",
    "progress",
]

ROUNDS_KEPT = 3  # a worker's round: the median of its last three (one outlier does not count)
NOISE_WEIGHT = 0.1  # the newest update's share in the smoothed noise terms
NOISE_UPDATES = 3  # updates of 2+ gradients before the noise scale is trusted
SWITCH_MARGIN = 0.05  # another R must promise this much more progress per second to be taken
LAG_WEIGHT = 0.3  # the newest update's share in an R's smoothed lag
LAG_HALF_LIFE = 10  # updates over which an R's lag not measured again loses half its excess


def progress(replicas: int, noise_scale: float) -> float:
    """Progress of an update averaging ``replicas`` gradients, relative to an exact gradient:
    ``R / (R + rho)`` (``rho`` infinite: proportional to R)."""
    if math.isinf(noise_scale):
        return float(replicas)
    return replicas / (replicas + noise_scale)


@dataclass(frozen=True)
class Decision:
    """What a policy sees before an update: the ``update`` (global step) being decided, the
    live workers' rounds in seconds, sorted (``rounds``; ``None``: not every live worker's
    round is measured yet), the noise scale ``rho`` (None: not measured yet) and each measured
    R's ``lags`` (how many times longer than ``T(R)`` its updates took, decayed)."""

    update: int
    live: int
    rounds: tuple[float, ...] | None
    noise_scale: float | None
    lags: dict[int, float] = field(default_factory=dict)


@runtime_checkable
class ReplicasPolicy(Protocol):
    """Chooses each update's R (1 <= R <= ``view.live``)."""

    def choose(self, view: Decision) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AutoReplicas:
    """The built-in policy (module docstring): the R with the most progress per second; while
    the noise is not measured yet, the most gradients per second; and the R it chose last
    until another is worth :data:`SWITCH_MARGIN` more."""

    def __init__(self) -> None:
        self.current: int | None = None  # the R chosen last

    def rates(self, view: Decision) -> dict[int, float]:
        """Progress per second of each R it may choose (module docstring); empty until every
        live worker's round is measured."""
        if view.rounds is None:
            return {}
        rho = math.inf if view.noise_scale is None else view.noise_scale
        low = min(view.live, 2)
        return {
            r: progress(r, rho) / max(view.rounds[r - 1] * view.lags.get(r, 1.0), 1e-9)
            for r in range(low, view.live + 1)
        }

    def choose(self, view: Decision) -> int:
        rates = self.rates(view)
        if not rates:
            return view.live
        best = max(rates, key=lambda r: (rates[r], r))  # ties: the larger R
        if self.current in rates and rates[best] <= rates[self.current] * (1 + SWITCH_MARGIN):
            best = self.current
        self.current = best
        return best

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = state.get("current")  # absent: a checkpoint from before it was kept
        self.current = None if current is None else int(current)


class Measurements:
    """The chief's record of rounds and gradient noise (module docstring)."""

    def __init__(self) -> None:
        self.rounds: dict[int, deque[float]] = {}
        # worker -> (token, when served, has its gradient of that token arrived)
        self.tokens: dict[int, tuple[int, float, bool]] = {}
        self.trace: float | None = None  # smoothed tr(Sigma) estimate
        self.signal: float | None = None  # smoothed |G|^2 estimate
        self.measured = 0  # updates folded into them
        # R -> (smoothed lag of updates made at R, the update that measured it last)
        self.lags: dict[int, tuple[float, int]] = {}
        self._parts: dict[int, list[float]] = {}  # update -> [sum |g_i|^2, |sum g_i|^2, k]

    # ------------------------------------------------------------------ events
    def served(self, worker: int, token: int, now: float) -> None:
        """``worker`` got its token ``token`` (the step its next gradient is computed at)."""
        self.tokens[worker] = (int(token), float(now), False)

    def arrived(self, worker: int, tag: int, now: float, timed: bool = True) -> None:
        """``worker``'s gradient computed at ``tag`` reached the chief: one round measured if
        its token ``tag`` was served here (and ``timed``: not a push that left its gradients
        behind, whose round skipped the transfer)."""
        token = self.tokens.get(worker)
        if token is None or token[0] != tag or token[2]:
            return
        self.tokens[worker] = (token[0], token[1], True)
        if timed:
            self.rounds.setdefault(worker, deque(maxlen=ROUNDS_KEPT)).append(now - token[1])

    def timed(self, worker: int, seconds: float) -> None:
        """One round of ``worker``, measured elsewhere (without a server: the seconds its
        last gradient took, as the update's leader read them on the store)."""
        self.rounds.setdefault(int(worker), deque(maxlen=ROUNDS_KEPT)).append(float(seconds))

    def lag(self, replicas: int, seconds: float, expected: float, update: int) -> None:
        """The update ``update``, made from ``replicas`` gradients, came ``seconds`` after the
        one before it, where ``T(R)`` said ``expected``: what an update at that R really costs,
        workers out of phase included (at least ``T(R)``: the lag is 1 or more)."""
        lag = max(float(seconds) / max(float(expected), 1e-9), 1.0)
        old = self.lags.get(int(replicas))
        smoothed = lag if old is None else old[0] + LAG_WEIGHT * (lag - old[0])
        self.lags[int(replicas)] = (smoothed, int(update))

    def noise(self, update: int, sum_sq: float, mean_sq: float, count: int) -> None:
        """One shard's part of ``update``'s noise terms: ``sum_sq`` = sum over its gradients of
        ``|g_i|^2``, ``mean_sq`` = ``|mean_i g_i|^2``, over its variables, of ``count``
        gradients.  Folded into the smoothed terms by :meth:`close_update`."""
        part = self._parts.setdefault(int(update), [0.0, 0.0, float(count)])
        part[0] += float(sum_sq)
        part[1] += float(mean_sq)
        part[2] = min(part[2], float(count))

    def close_update(self, update: int) -> None:
        """Every shard reported ``update``: its noise terms join the smoothed ones."""
        for u in [u for u in self._parts if u <= update]:
            sum_sq, mean_sq, k = self._parts.pop(u)
            if u != update or k < 2:
                continue
            trace = k / (k - 1) * (sum_sq / k - mean_sq)
            signal = mean_sq - trace / k
            self.measured += 1
            if self.trace is None or self.signal is None:
                self.trace, self.signal = trace, signal
            else:
                self.trace += NOISE_WEIGHT * (trace - self.trace)
                self.signal += NOISE_WEIGHT * (signal - self.signal)

    def forget(self, worker: int) -> None:
        """``worker`` left: its token is void (its rounds stay, for when it comes back)."""
        self.tokens.pop(worker, None)

    # ------------------------------------------------------------------ the view
    def noise_scale(self) -> float | None:
        """``rho = tr(Sigma) / |G|^2`` from the smoothed terms; infinite when the noise
        swamps the signal, None before :data:`NOISE_UPDATES` updates of two or more gradients."""
        if self.trace is None or self.signal is None or self.measured < NOISE_UPDATES:
            return None
        if self.signal <= 0:
            return math.inf
        return max(self.trace, 0.0) / self.signal

    def recent_lags(self, update: int) -> dict[int, float]:
        """Each R's smoothed lag as of ``update``: its excess over 1 halves every
        :data:`LAG_HALF_LIFE` updates since it was last measured, so an R that was costly once
        (a slowdown since gone) is tried again, and one still costly is soon measured so again:
        the exploration is bounded by the half-life."""
        return {
            r: 1.0 + (f - 1.0) * 0.5 ** (max(update - u, 0) / LAG_HALF_LIFE)
            for r, (f, u) in self.lags.items()
        }

    def expected_rounds(self, now: float, live: Iterable[int]) -> tuple[float, ...] | None:
        """Each live worker's round in seconds, sorted (a late one: twice its time so far);
        None until every live worker has a measured round."""
        out = []
        for w in live:
            if w not in self.rounds:
                return None
            d = statistics.median(self.rounds[w])
            token = self.tokens.get(w)
            if token is not None and not token[2] and now - token[1] > d:
                d = 2 * (now - token[1])
            out.append(d)
        return tuple(sorted(out))

    def latest_rounds(self, live: Iterable[int]) -> tuple[float, ...] | None:
        """Each live worker's latest round in seconds, sorted; None until every one is
        measured."""
        out = []
        for w in live:
            if w not in self.rounds:
                return None
            out.append(self.rounds[w][-1])
        return tuple(sorted(out))

    def overdue(self, now: float, live: Iterable[int]) -> list[int]:
        """Live workers whose gradient is not in after over twice their usual round."""
        out = []
        for w in live:
            token = self.tokens.get(w)
            if w in self.rounds and token is not None and not token[2]:
                if now - token[1] > 2 * statistics.median(self.rounds[w]):
                    out.append(w)
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Rounds and the smoothed noise; not the token times (a clock that does not survive
        a restart)."""
        return {
            "rounds": {int(w): list(r) for w, r in self.rounds.items()},
            "trace": self.trace,
            "signal": self.signal,
            "measured": self.measured,
            "lags": {int(r): [f, u] for r, (f, u) in self.lags.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = {
            int(w): deque((float(x) for x in r), maxlen=ROUNDS_KEPT)
            for w, r in state["rounds"].items()
        }
        self.trace, self.signal = state["trace"], state["signal"]
        self.measured = int(state["measured"])
        saved = state.get("lags", {})  # absent: a checkpoint from before they were kept
        self.lags = {int(r): (float(f), int(u)) for r, (f, u) in saved.items()}
        self.tokens, self._parts = {}, {}
