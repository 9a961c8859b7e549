"""The chief's record of each update's R: fixed, or chosen by a policy from what it measured.

:class:`ReplicaChoice` keeps the R of the pending update (and of recent ones: a shared-queue
token may name an older step, and its pushes carry that step's R), the history of every update
made, and, with a policy (``replicas_to_aggregate="auto"``), the :class:`~.replicas_policy.
Measurements` the policy decides from.  The chief tells it what happened (a token served, a
gradient arrived, an update made, a worker left) and asks it what R an update takes; it logs
each decision at DEBUG.  Pure bookkeeping: times are passed in, no I/O.

A live standby of the chief (:mod:`...hosting.standby`) does not choose: a policy's choice
depends on the clock of the host that measured the rounds.  Each copy of a request carries its
primary's choices and measurements (:meth:`ReplicaChoice.live_state`); the standby
:meth:`~ReplicaChoice.follow` s them while it handles the copy, and loads them after it, so
its R of every update, its policy's state and its measurements are its primary's.  A standby
that took over (its first request comes from a worker, with no choices) chooses from then on.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

from .replicas_policy import Decision, Measurements, ReplicasPolicy

__all__ = ["ReplicaChoice"]

log = logging.getLogger(__name__)

KEPT_STEPS = 64  # a token older than this many updates is stale whatever its R


class ReplicaChoice:
    """Each update's R (module docstring): ``replicas`` fixed, or chosen by ``policy``."""

    def __init__(self, replicas: int, policy: ReplicasPolicy | None) -> None:
        self.fixed, self.policy = replicas, policy
        self.measured = Measurements()
        self.history: list[int] = []  # the R of every update made, in order
        self.replicas: dict[int, int] = {}  # step -> the R of its update
        self._last_made: float | None = None  # when the last update was made (made's now)
        self._expected: dict[int, float] = {}  # step -> T(R) when its R was chosen
        self._given: dict[int, int] | None = None  # a standby's: its primary's R per step

    def of(self, step: int, current: int) -> int:
        """The R of the update at ``step`` (a token's), else of the update at ``current``."""
        return self.replicas.get(step, self.replicas[current])

    # ------------------------------------------------------------------ decisions
    @property
    def following(self) -> bool:
        """A standby's: the R of each update is its primary's, not chosen here."""
        return self._given is not None

    def follow(self, primary: dict[str, Any] | None) -> None:
        """Take each update's R from ``primary`` (its :meth:`live_state` after the request
        being replayed) instead of choosing; None: choose (a primary, or a standby that took
        over)."""
        self._given = (
            None if primary is None else {int(k): int(v) for k, v in primary["pending"].items()}
        )

    def decide(self, step: int, live: Sequence[int], now: float) -> int:
        """The R of the update at ``step``: fixed, its primary's (a standby's), or the policy's
        choice (logged)."""
        if self.policy is None:
            r = self.fixed
        elif self._given is not None and step in self._given:
            r = self._given[step]
        else:
            view = self._view(step, live, now)
            r = self.policy.choose(view)
            if view.rounds is not None and 1 <= r <= len(view.rounds):
                self._expected[step] = view.rounds[r - 1]
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
        for old in [s for s in self.replicas if s < step - KEPT_STEPS]:
            del self.replicas[old]
        return r

    def fewer(self, step: int, live: Sequence[int]) -> int | None:
        """A worker left: the lower R of the pending update, if the live ones are fewer
        (a policy's choice only: a fixed R is TF's, and waits as TF's does)."""
        count = max(len(live), 1)
        if self.policy is None or self.replicas.get(step, 0) <= count:
            return None
        return self._lower(step, count, "a worker left")

    def reconsider(self, step: int, live: Sequence[int], now: float) -> int | None:
        """While the update at ``step`` waits: once a live worker whose gradient is not in has
        taken over twice its usual round (dead, or slowed down since the choice), choose again
        with what is known now; the lower R, if the policy would take fewer.  Never a higher
        one: the workers' pushes to other shards carry the R they were told."""
        if self.policy is None or self._given is not None or step not in self.replicas:
            return None  # (a standby: its primary's tick lowers it, and says so in a copy)
        late = self.measured.overdue(now, live)
        if not late:
            return None
        before = copy.deepcopy(self.policy.state_dict())
        r = self.policy.choose(self._view(step, live, now))
        if not isinstance(r, int) or not 1 <= r < self.replicas[step]:
            # a choice not taken leaves the policy as it was (AutoReplicas would otherwise
            # keep it as "the R chosen last", which its margin then holds on to)
            self.policy.load_state_dict(before)
            return None
        return self._lower(step, r, f"worker(s) {late} overdue")

    def lowered(self, step: int, r: int) -> int:
        """A standby: its primary lowered the pending update's R to ``r`` on a tick."""
        return self._lower(step, r, "its primary lowered it")

    def _lower(self, step: int, r: int, why: str) -> int:
        log.debug("SyncReplicas chief: update %d now waits for R=%d (%s)", step, r, why)
        self.replicas[step] = r
        self._expected.pop(step, None)  # chosen again mid-way: its lag says nothing of R
        return r

    def _view(self, step: int, live: Sequence[int], now: float) -> Decision:
        return Decision(
            update=step,
            live=max(len(live), 1),
            rounds=self.measured.expected_rounds(now, live),
            noise_scale=self.measured.noise_scale(),
            lags=self.measured.recent_lags(step),
        )

    # ------------------------------------------------------------------ events
    def made(
        self,
        update: int,
        now: float | None = None,
        interval: float | None = None,
        live: Sequence[int] = (),
    ) -> None:
        """The update at ``update`` was made on every shard: at ``now`` (on the clock of the
        other calls), or ``interval`` seconds after the one before (as measured elsewhere, the
        same on every rank).  With either, its lag: the interval against the T(R) it was
        chosen by, or the R-th of the ``live`` workers' latest rounds if longer (a slowdown
        that came after the choice is the rounds', not the R's)."""
        r = self.replicas.get(update, self.fixed)
        self.history.append(r)
        self.measured.close_update(update)
        if now is not None:
            if self._last_made is not None:
                interval = now - self._last_made
            self._last_made = now
        expected = self._expected.pop(update, None)
        for old in [s for s in self._expected if s < update]:
            del self._expected[old]
        if self.policy is None or interval is None or expected is None:
            return
        latest = self.measured.latest_rounds(live)
        if latest is not None and r <= len(latest):
            expected = max(expected, latest[r - 1])
        self.measured.lag(r, interval, expected, update)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), **self.live_state()}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """The history, the pending update's R and the policy's state, so a resumed job goes
        on choosing as it would have (None: a checkpoint from before R was recorded)."""
        if saved is None:
            self.history, self.replicas = [], {}
            return
        self.history = [int(r) for r in saved["history"]]
        self.load_live(saved)

    def live_state(self) -> dict[str, Any]:
        """What a standby's copy of a request carries (module docstring): the state without
        the history, which each copy keeps itself; bounded, and the keys survive the wire's
        JSON (they are read back with ``int()``)."""
        return {
            "pending": {int(k): int(v) for k, v in self.replicas.items()},
            "policy": None if self.policy is None else self.policy.state_dict(),
            "measured": None if self.policy is None else self.measured.state_dict(),
            "expected": {int(k): float(v) for k, v in self._expected.items()},
        }

    def load_live(self, saved: dict[str, Any]) -> None:
        """A :meth:`live_state` (or a checkpoint's): the pending R, the policy's state, the
        measurements."""
        self.replicas = {int(k): int(v) for k, v in saved["pending"].items()}
        # absent: a checkpoint from before lags were measured
        self._expected = {int(k): float(v) for k, v in saved.get("expected", {}).items()}
        if self.policy is not None and saved["policy"] is not None:
            self.policy.load_state_dict(saved["policy"])
            self.measured.load_state_dict(saved["measured"])
