"""Who is in the next generation of a group that may lose and regain members.

When a group of ranks breaks (a member died, or a restarted one asks to join), every live
candidate -- the old members and the ranks asking to join -- announces itself (*here*), and
the new members are decided once each candidate is known: here, or dead.  A candidate is dead
when its heartbeat counter has not moved for ``dead_after`` seconds: a process that is merely
slow (computing, or blocked in its own step) keeps beating from a thread of its own and is
waited for; one that was killed stops at once.  A candidate that neither arrives nor dies
within ``timeout`` seconds (alive but stuck) is left out too, and may join again later.
Silence is only counted while the observer itself looks often (observations less than
``dead_after / 2`` apart): an observer that was starved of CPU on a loaded machine cannot
tell a still counter from one it did not watch, so its clocks start again.

The same rule watches a group at work (:class:`Silence`): a member whose heartbeat stands
still for ``dead_after`` while the others wait on it in a collective is taken as lost then,
not at the collective's timeout -- a stopped process, or a host cut off from the network,
never closes its sockets.

Pure bookkeeping on the observations it is given: no I/O, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["Quorum", "Silence"]


class Silence:
    """Which ranks' heartbeat counters stood still for ``dead_after`` seconds, as watched.

    Silence is counted only while the observer looks often (observations less than
    ``dead_after / 2`` apart); after a longer gap every clock starts again."""

    def __init__(self, dead_after: float) -> None:
        if not dead_after > 0:
            raise ValueError(f"dead_after must be positive, got {dead_after}")
        self.dead_after = dead_after
        self._beats: dict[int, tuple[int | None, float]] = {}  # rank -> (counter, since)
        self._last: float | None = None  # the previous observation's time

    def observe(self, now: float, beats: Mapping[int, int | None]) -> set[int]:
        """The ranks of ``beats`` (rank -> its counter now, None: it never beat) whose
        counter has not moved for ``dead_after`` seconds."""
        if self._last is not None and now - self._last > self.dead_after / 2:
            self._beats.clear()  # this observer was not watching: the silences start again
        self._last = now
        for r, count in beats.items():
            seen = self._beats.get(r)
            if seen is None or seen[0] != count:
                self._beats[r] = (count, now)
        return {r for r in beats if now - self._beats[r][1] >= self.dead_after}


class Quorum:
    """The decision on one generation's members (module docstring)."""

    def __init__(
        self,
        candidates: Iterable[int],
        dead_after: float,
        timeout: float,
        start: float,
        silence: Silence | None = None,
    ) -> None:
        """``silence``: the observations so far (a watch that saw a member fall silent), to
        go on from rather than start the clocks again."""
        if not 0 < dead_after <= timeout:
            raise ValueError(f"dead_after must be in (0, timeout={timeout}], got {dead_after}")
        self.candidates = frozenset(int(r) for r in candidates)
        self.dead_after, self.timeout, self.start = dead_after, timeout, start
        self._silence = silence if silence is not None else Silence(dead_after)
        self.dead: set[int] = set()
        self.stuck: set[int] = set()

    def observe(
        self, now: float, here: Iterable[int], beats: Mapping[int, int | None]
    ) -> list[int] | None:
        """The members (sorted) once every candidate is here or gone, else None.

        ``here``: the candidates that announced themselves; ``beats``: each absent
        candidate's heartbeat counter now (None: it never beat)."""
        arrived = self.candidates & {int(r) for r in here}
        absent = self.candidates - arrived
        self.dead = self._silence.observe(now, {r: beats.get(r) for r in absent})
        if arrived | self.dead >= self.candidates:
            self.stuck = set()
            return sorted(arrived)
        if now - self.start >= self.timeout:
            self.stuck = absent - self.dead
            return sorted(arrived)
        return None
