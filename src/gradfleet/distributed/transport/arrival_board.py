"""Who came first: the store's small control messages that let R of N ranks make an update
without a server (:mod:`..sync.worker.first_arrivals`).

Every rank holds the same state at step ``t`` and counts itself in when its gradient is ready:
the store's atomic ``add`` gives each arrival its place, so the first R places are the update's
members on every rank without anyone deciding.  The members name themselves under their
places, and the update's leader (the first to arrive) says when the update is made, so a rank
that came late (or not at all) knows whose update to receive.  Nothing parameter-sized goes
through the store: the gradients travel on the process groups.

Keys, under ``gradfleet/first/<exchange>/<epoch>/g<generation>/`` on the job's store
(``<exchange>``: this process's n-th exchange, alike on every rank; ``<epoch>``: state loads
since, so that a reloaded step never meets the arrivals of its first pass; ``<generation>``:
the members' generation, which changes when one is lost or joins):

* ``a/<t>``: arrivals at step ``t`` (a counter);
* ``w/<t>/<place>``: the rank that arrived at that place;
* ``i/<t>/<rank>``: that rank counted in at step ``t``: its place and the seconds its gradient
  took; ``last/<rank>``: the step and seconds of its latest arrival (what a worker deferring
  to it asks, :mod:`..sync.worker.deference`);
* ``d/<t>``: the update made at ``t``: ``{"leader": rank, "members": [ranks]}`` (JSON; with
  ``replicas_to_aggregate="auto"`` also ``"rounds"``: each worker's last gradient's seconds,
  ``"interval"``: the seconds since the update before, on the leader's clock, and
  ``"exchange"``: the seconds the leader spent exchanging it);
* ``dropped/<rank>``: gradients of ``rank`` that came after the first R (a counter, under
  ``<epoch>/`` only: it outlives a generation);
* ``ended``: why the job ended, written by the first rank that met a lost peer, so that a rank
  waiting on the store for the others hears it at once rather than at the timeout;
* ``pg/<r1-r2-...>/...``: the rendezvous of those members' own gloo group
  (:meth:`ArrivalBoard.members_group`, made the first time they make an update together, kept
  for the exchange's life: ``torch.distributed.new_group`` would have every rank take part).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import LINK_ERRORS, LinkLost

__all__ = ["ArrivalBoard", "Made"]

NAMESPACE = "gradfleet/first/"
_SLICE = timedelta(milliseconds=100)  # a waiting rank hears that the job ended this soon


@dataclass(frozen=True)
class Made:
    """An update as its leader announced it: who made it, the leader first."""

    leader: int
    members: tuple[int, ...]
    rounds: dict[int, float] = field(default_factory=dict)  # replicas_to_aggregate="auto"
    interval: float | None = None  # "auto": seconds since the update before, the leader's clock
    exchange: float | None = None  # "auto": the seconds the leader spent exchanging it


def _nothing_to_watch() -> Callable[[], str | None]:
    return lambda: None


class ArrivalBoard:
    """Rank ``rank``'s view of the arrivals of a job of ``world`` ranks (module docstring).

    ``watcher`` makes, for each wait on the others, a check called between slices that says
    why the wait will never end (a member's heartbeat stood still, the members re-forming:
    ``ElasticGroup.watcher``); ``exchange`` names this exchange on the store (default: this
    process's n-th, alike on every rank; an elastic job's names one, since a restarted process
    counts from 1 again)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        timeout: float,
        watcher: Callable[[], Callable[[], str | None]] = _nothing_to_watch,
        exchange: str | None = None,
    ) -> None:
        self.rank, self.world, self.timeout = rank, world, timedelta(seconds=timeout)
        self.watcher = watcher
        self.root = dist.PrefixStore(NAMESPACE, store)
        # the n-th exchange of this process: every rank builds its exchanges in the same order
        self.exchange = exchange or str(self.root.add(f"made/{rank}", 1))
        self.epoch = self.generation = 0
        self._groups: dict[tuple[int, ...], Any] = {}
        self._scope()

    def _scope(self) -> None:
        self.books = dist.PrefixStore(f"{self.exchange}/{self.epoch}/", self.root)
        self.store = dist.PrefixStore(f"g{self.generation}/", self.books)
        self._arrived: set[int] = set()  # ranks whose last/<rank> is set in this scope
        self._groups.clear()  # another generation's members meet in groups of their own

    def new_epoch(self, epoch: int | None = None) -> None:
        """A state was loaded on every rank (``epoch``: the one a live member's books carry):
        steps may repeat, the arrivals start afresh."""
        self.epoch = self.epoch + 1 if epoch is None else int(epoch)
        self._scope()

    def new_generation(self, generation: int) -> None:
        """The members changed (a loss, a join): the arrivals start afresh among them."""
        self.generation = int(generation)
        self._scope()

    # ------------------------------------------------------------------ arriving
    def arrive(self, step: int, pace: float = 0.0) -> int:
        """Count this rank in at ``step``, whose gradient took ``pace`` seconds: its place,
        1 for the first."""
        place = int(self.store.add(f"a/{step}", 1))
        keys = [f"w/{step}/{place}", f"i/{step}/{self.rank}", f"last/{self.rank}"]
        values = [str(self.rank), f"{place} {pace!r}", f"{step} {pace!r}"]
        try:
            self.store.multi_set(keys, values)
        except RuntimeError:  # a store of an older torch without it: one set each
            for key, value in zip(keys, values, strict=True):
                self.store.set(key, value)
        return place

    def came(self, step: int, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that counted in at ``step`` (so far; none before step 0)."""
        if step < 0:
            return []
        return [r for r in ranks if self.store.check([f"i/{step}/{r}"])]

    def lately(self, step: int, ranks: list[int], back: int) -> dict[int, float]:
        """Those of ``ranks`` whose last arrival was at one of the ``back`` steps before
        ``step``, with the seconds their gradient took there."""
        # once a rank has arrived its key stays (in this scope): ask the store only for others
        self._arrived.update(
            r for r in ranks if r not in self._arrived and self.store.check([f"last/{r}"])
        )
        present = [r for r in ranks if r in self._arrived]
        if not present:
            return {}
        values = self._get([f"last/{r}" for r in present])
        out = {}
        for r, value in zip(present, values, strict=True):
            at, pace = value.decode().split()
            if step - back <= int(at) < step:
                out[r] = float(pace)
        return out

    def _get(self, keys: list[str]) -> list[bytes]:
        try:
            return list(self.store.multi_get(keys))
        except RuntimeError:  # a store of an older torch without it: one get each
            return [self.store.get(k) for k in keys]

    def first(self, step: int, R: int) -> list[int]:
        """The ranks at places 1..R of ``step``, in order of arrival (waits for them: a
        member calls this, so R have arrived or are arriving)."""
        keys = [f"w/{step}/{place}" for place in range(1, R + 1)]
        self._wait(keys, f"the other {R - 1} first arrivals at step {step}")
        return [int(v) for v in self._get(keys)]

    def arrivals(self, step: int) -> int:
        """How many ranks arrived at ``step`` so far."""
        return int(self.store.add(f"a/{step}", 0))

    # ------------------------------------------------------------------ the update
    def made(
        self,
        step: int,
        leader: int,
        members: list[int],
        rounds: dict[int, float] | None = None,
        interval: float | None = None,
        exchange: float | None = None,
    ) -> None:
        """The leader: the update at ``step`` is made, and its data is on the way; with
        ``rounds``, the seconds each worker's last gradient took, as the leader read them, and
        ``interval``, the seconds since it saw the update before made, and ``exchange``, the
        seconds from the first R's arrival to this record (what every rank's choice of the next
        R is made from)."""
        record: dict[str, Any] = {"leader": leader, "members": members}
        if rounds is not None:
            record["rounds"] = {str(r): s for r, s in rounds.items()}
        if interval is not None:
            record["interval"] = interval
        if exchange is not None:
            record["exchange"] = exchange
        self.store.set(f"d/{step}", json.dumps(record))

    def is_made(self, step: int) -> bool:
        """Has the update at ``step`` been announced?"""
        return self.store.check([f"d/{step}"])

    def wait_made(self, step: int) -> Made:
        """A rank that came late: the update at ``step`` as its leader announced it."""
        key = f"d/{step}"
        self._wait([key], f"the update at step {step} (this rank came after the first)")
        record = json.loads(self.store.get(key))
        rounds = {int(r): float(s) for r, s in record.get("rounds", {}).items()}
        interval, exchange = record.get("interval"), record.get("exchange")
        members = tuple(int(r) for r in record["members"])
        return Made(int(record["leader"]), members, rounds, interval, exchange)

    def members_group(self, members: list[int]) -> Any:
        """The gloo process group of ``members`` (sorted ranks, this one among them), made
        with the others the first time (each of them calls this at the same step)."""
        key = tuple(members)
        if key not in self._groups:
            store = dist.PrefixStore(f"pg/{'-'.join(map(str, key))}/", self.store)
            self._groups[key] = dist.ProcessGroupGloo(
                store, key.index(self.rank), len(key), self.timeout
            )
        return self._groups[key]

    def close(self) -> None:
        self._groups.clear()

    # ------------------------------------------------------------------ counters
    def count_dropped(self) -> None:
        self.books.add(f"dropped/{self.rank}", 1)

    def dropped(self) -> dict[int, int]:
        """Each rank's gradients that came after the first R, in this epoch."""
        return {r: int(self.books.add(f"dropped/{r}", 0)) for r in range(self.world)}

    # ------------------------------------------------------------------ the end
    def end(self, why: str) -> None:
        """This rank met a lost peer: tell every rank waiting on the store (best effort: the
        store's host may be the one lost)."""
        try:
            self.root.compare_set(f"{self.exchange}/ended", "", why)
        except LINK_ERRORS:
            pass

    def _wait(self, keys: list[str], what: str) -> None:
        """Until ``keys`` are set, in slices, between which a job ended by another rank is
        heard (``ConnectionError`` naming it); ``TimeoutError`` after the timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        check = self.watcher()
        while True:
            try:
                self.store.wait(keys, _SLICE)
                return
            except (*LINK_ERRORS, RuntimeError) as exc:
                if not _timed_out(exc):  # the store's host is gone
                    raise
            ended = f"{self.exchange}/ended"
            if self.root.check([ended]):
                raise ConnectionError(
                    f"rank {self.rank}: waiting for {what}, the job ended: "
                    f"{self.root.get(ended).decode()}"
                )
            if why := check():
                raise LinkLost(f"rank {self.rank}: waiting for {what}: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.rank}: waited {self.timeout.total_seconds():g}s for {what}"
                )


def _timed_out(exc: BaseException) -> bool:
    """A store's wait that timed out (TCPStore: ``DistStoreError``; FileStore and HashStore:
    a plain ``RuntimeError``), not a lost store."""
    return "timeout" in str(exc).lower() and not isinstance(exc, dist.DistNetworkError)
