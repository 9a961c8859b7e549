"""``SyncReplicasOptimizer``'s queries of its servers: counters, moving averages, silence,
and ``forget_workers`` (a mixin over the optimizer's links, like :mod:`.checkpoint`).

Each question goes to the server that knows the answer: the chief (shard 0) for the workers'
silence, every shard for the moving averages and forgotten workers, one shard for its
accumulator counts; lockstep (``transport="allreduce"``) answers from its own accumulator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["SyncQueries"]

_OWNER = "SyncReplicasOptimizer"


class SyncQueries:
    """The read-only questions and ``forget_workers`` of ``SyncReplicasOptimizer``."""

    total_num_replicas: int
    _index: dict[int, int]
    _parts: list[list[int]]
    _servers: Any
    _allreduce: Any
    _links: Any
    wait_reads: Callable[[], None]

    def _settled_links(self, what: str) -> Any:
        """The links, once the last step's streamed reads are in (they share the links)."""
        if self._allreduce is not None:
            raise RuntimeError(
                f"{_OWNER}.{what}: this job has no server (transport='allreduce': R == N "
                "workers all-reduce); name server_rank= or server_ranks= to have one"
            )
        if self._links is None:
            raise RuntimeError(f"{_OWNER}.{what}: the optimizer is closed")
        self.wait_reads()
        return self._links

    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]:
        """Per-worker accepted / dropped / nonfinite counts as the server (``shard``'s
        accumulators when sharded) saw them."""
        if self._allreduce is not None:
            return self._allreduce.stats
        links = self._settled_links("worker_counters")
        if shard not in links.clients:
            raise ValueError(f"{_OWNER}.worker_counters: no shard {shard!r}")
        stats = links.call(shard, "stats")["stats"]
        return {int(k): v for k, v in stats.items()}

    def averaged_variables(self) -> list[torch.Tensor | None]:
        """Moving averages of the variables, in parameter order (None if not averaged);
        sharded: gathered from every shard."""
        chief = self._servers.chief if self._servers is not None else None
        if self._allreduce is not None or (len(self._parts) == 1 and chief is not None):
            ema = self._allreduce.ema if self._allreduce is not None else None
            ema = ema if ema is not None or chief is None else chief.ema
            if ema is None:
                raise RuntimeError(f"{_OWNER}: no variable_averages here (read them on the chief)")
            return [ema.shadows.get(i) for i in range(len(self._index))]
        links = self._settled_links("averaged_variables")
        pairs = [p for reply in links.call_all("ema").values() for p in reply["shadows"]]
        found = {int(i): s for i, s in pairs}
        return [found.get(i) for i in range(len(self._index))]

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker sent to the servers (all-reduce: bytes reduced)."""
        if self._allreduce is not None:
            return self._allreduce.bytes_sent
        return self._links.bytes_out if self._links is not None else 0

    @property
    def withheld_pushes(self) -> int:
        """Pushes this worker sent without their gradients because it had seen their shard
        past their step already (TF's accumulators drop such stale gradients; the shard
        counts each as dropped): the bytes a backup worker or a surplus token saves."""
        return self._links.withheld if self._links is not None else 0

    def worker_silence(self) -> dict[int, float]:
        """Seconds since the chief last heard from each worker that has not left (a worker
        that never said hello: since the chief started).  Job control can declare a worker
        lost (:meth:`forget_workers`) once its silence is far above a step's time."""
        report = self._settled_links("worker_silence").call(0, "members")
        return {int(w): float(s) for w, s in report["silence"].items()}

    def forget_workers(self, ranks: Iterable[int]) -> None:
        """Count the workers ``ranks`` as having left (they died and will not come back), on
        every server: a server rank's :meth:`close` then stops waiting for them at once
        instead of after ``timeout`` seconds of their silence.  Any rank may call it; a
        forgotten worker that does come back (``hello``) is counted again.  Without a server
        (``transport="allreduce"``) there is nobody to tell: the ranks are only checked."""
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < self.total_num_replicas]
        if bad:
            raise ValueError(
                f"{_OWNER}.forget_workers: ranks must be in [0, {self.total_num_replicas}), "
                f"got {bad}"
            )
        if self._allreduce is None:
            self._settled_links("forget_workers").forget(ranks)
