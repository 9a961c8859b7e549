"""Who waits for whom, so that every worker's data is heard (backup workers without a server,
:mod:`.first_arrivals`).

With the first R of N making each update, a worker that came late once receives the update
after the members have it, so it starts its next gradient later and comes late again, even
when every worker computes as fast as the others: a phase that nothing resets.  Its shard of
the data is then never trained on.

The rule, the same on every worker (each decides only its own wait, from what every rank
sees alike: the members of each update, and who counted in at each step with what pace):

* worker ``me`` **owes** a live worker ``r`` when, over the last :data:`WINDOW` x N updates,
  ``me``'s gradients went into at least :data:`MARGIN` more of them than ``r``'s, ``r`` was
  not in the last update, ``r`` counted in at one of the :data:`RECENT` steps before this
  one (it is still coming: a worker whose link is slow to bring it the updates may be a few
  steps behind), and ``r`` is about as fast as ``me``: its last gradient took at most
  ``SAME_PACE - 1`` (20%) of the longer of ``me``'s median time per gradient and the median
  time between updates more than ``me``'s.  A worker slower than that is what backup workers
  are for, and is not waited for;
* before counting itself in at a step, ``me`` **defers**: it waits until every worker it owes
  has counted in, for at most the *grace*, :data:`GRACE` x the median of the last
  :data:`INTERVALS` times between updates (enough for a late worker that fell a whole step
  behind), or until the step has its R without them;
* a worker owed that does not come within the grace is not waited for again until 1, then 2,
  4 and at most :data:`MAX_SKIP` updates later; one that comes is waited for whenever owed.

Once owed, the late worker is the first to count in, so it makes the next update, and another
worker becomes the late one until it is owed in turn: the late place rotates, at most every
:data:`MARGIN` updates or so, and each rotation costs one wait.  Pure: no I/O and no clock of
its own (the caller passes step numbers, times, and who came with what pace).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "GRACE", "INTERVALS", "MARGIN", "MAX_SKIP", "RECENT", "SAME_PACE", "WINDOW", "Deference",
]  # fmt: skip

WINDOW = 8  # x N: the updates a worker's share is counted over
MARGIN = 8  # updates more than another in the window: that one is owed
SAME_PACE = 1.2  # a worker at most this much slower per gradient is about as fast
GRACE = 1.5  # x the median time between updates: the longest wait for an owed worker
INTERVALS = 8  # updates (and gradients) the medians are taken over
MAX_SKIP = 8  # updates: the longest pause in waiting for a worker that did not come
RECENT = 8  # steps: a worker that counted in at one of the last RECENT steps is still coming


def _median_gap(times: deque[float]) -> float:
    t = list(times)
    return statistics.median(b - a for a, b in zip(t, t[1:], strict=False))


class Deference:
    """One worker's side of the rule (module docstring), in a job of ``world`` workers;
    ``margin``: :data:`MARGIN` (``math.inf``: never wait, the first R always make the
    update)."""

    def __init__(self, world: int, margin: float = MARGIN) -> None:
        self.window, self.margin = WINDOW * world, margin
        self._updates: deque[float] = deque(maxlen=INTERVALS + 1)
        self._gradients: deque[float] = deque(maxlen=INTERVALS)
        self._misses: dict[int, int] = {}  # owed workers that did not come, in a row
        self._paused_until: dict[int, int] = {}  # the first step one is waited for again
        self.waits = 0  # times this worker deferred
        self.waited = 0.0  # seconds it spent deferring

    # ------------------------------------------------------------------ measurements
    def updated(self, now: float) -> None:
        """An update was applied at ``now`` (seconds on any monotonic clock)."""
        self._updates.append(now)

    def computed(self, seconds: float) -> None:
        """This worker took ``seconds`` to compute a gradient (from one step's end to the
        next's start)."""
        self._gradients.append(seconds)

    def pace(self) -> float:
        """This worker's median seconds per gradient (0 before the first)."""
        return statistics.median(self._gradients) if self._gradients else 0.0

    def last(self) -> float:
        """The seconds this worker's last gradient took (0 before the first): what it tells
        the others, so that one that has just recovered is waited for at once."""
        return self._gradients[-1] if self._gradients else 0.0

    def grace(self) -> float:
        """The longest wait for an owed worker: 0 until :data:`INTERVALS` updates are timed."""
        if len(self._updates) <= INTERVALS:
            return 0.0
        return GRACE * _median_gap(self._updates)

    # ------------------------------------------------------------------ the rule
    def candidates(
        self, me: int, step: int, history: Sequence[Iterable[int]], live: Iterable[int]
    ) -> list[int]:
        """The live workers ``me`` may owe at ``step``: heard at least ``margin`` fewer times
        than ``me`` in the window, and not paused (whether each is still coming, and at what
        pace, is the caller's question to the store: :meth:`owed`)."""
        if self.grace() <= 0:
            return []
        live = list(live)
        counts = dict.fromkeys(live, 0)
        for members in history[-self.window :]:
            for r in members:
                if r in counts:
                    counts[r] += 1
        mine = counts.get(me, 0)
        last = set(history[-1]) if history else set()  # in phase again: no need to wait
        return [
            r for r in live
            if r != me and r not in last and mine - counts[r] >= self.margin
            and self._paused_until.get(r, 0) <= step
        ]  # fmt: skip

    def owed(self, candidates: Iterable[int], lately: Mapping[int, float]) -> list[int]:
        """Of ``candidates``, those in ``lately`` (counted in at one of the :data:`RECENT` steps
        before this one, with their last gradient's seconds) about as fast as this worker: slower
        by at most ``SAME_PACE - 1`` of the longer of its time per gradient and the time
        between updates (where moving the update takes most of the time, a worker a little
        slower to compute costs little to wait for)."""
        if len(self._updates) <= INTERVALS:
            return []
        mine = self.pace()
        limit = mine + (SAME_PACE - 1) * max(mine, _median_gap(self._updates))
        return [r for r in candidates if r in lately and lately[r] <= limit]

    def settle(self, step: int, owed: Iterable[int], came: Iterable[int], waited: float) -> None:
        """After deferring at ``step`` to ``owed`` for ``waited`` seconds: those that ``came``
        are waited for again when owed; the others are paused 1, 2, 4 ... updates."""
        came = set(came)
        self.waits += 1
        self.waited += waited
        for r in owed:
            if r in came:
                self._misses.pop(r, None)
                self._paused_until.pop(r, None)
            else:
                misses = self._misses[r] = self._misses.get(r, 0) + 1
                self._paused_until[r] = step + 1 + min(2 ** (misses - 1), MAX_SKIP)
