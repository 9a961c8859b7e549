"""Pacing: when a reading-ahead worker's next push may leave.

Why: sent all at once, a worker's pushes share its link and each arrives only at the end, so no
shard can update (and send its values back) before every gradient is out.  Paced, a worker's
pushes follow each other in :func:`~.shard_clients.push_order`, the shards update one after
another, and their values travel back while later gradients still go out, as BytePS schedules
its partitions with a credit of bytes.  Unlike waves (each sent once the last one's shards
answered), no push waits for another worker, and on the emulated cluster pacing is no slower
than waves.

The rule: a push of at least ``PACED_BYTES`` of gradients asks its server for a receipt, and the
next push to a server rank leaves once fewer than ``per_rank`` of this worker's pushes to that
rank are unconfirmed (oldest first). ``per_rank`` is 1 where the worker's receipted pushes go to
several server ranks: every rank then takes one push from each worker at a time, TCP shares each
link evenly between them, and a rank's shards still complete in push order, as when each
worker's pushes to a rank queue on one connection (``benchmarks/cluster/link_ceiling.py``'s
pattern). A total credit (two pushes in flight, whichever ranks they go to) left one server
host's link taking pushes from three workers while another's idled: 4 dedicated server hosts ran
at 0.85-0.88x DDP, 0.92-0.94x with one per rank (docs/cluster.md). Where one rank takes them
all, ``per_rank`` is ``IN_FLIGHT``: with one at a time its link would idle for each receipt's
round trip.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from ...transport import MailboxClient

__all__ = ["IN_FLIGHT", "PACED_BYTES", "Pacing"]

IN_FLIGHT = 2  # pushes a worker has sent to one server rank that it has not yet received
# Smaller pushes are not paced: they cross a link in less time than a receipt costs the
# worker's and the server's threads, and the kernel's socket buffers take them whole anyway.
PACED_BYTES = 1 << 20


class Pacing:
    """One worker's pushes on their way to ``clients`` (shard -> its client; shard ``k`` on
    server rank ``ranks[k]``), unconfirmed; ``timeout``: how long one receipt may take."""

    def __init__(
        self, clients: Mapping[int, MailboxClient], ranks: Sequence[int], timeout: float
    ) -> None:
        self._clients, self._timeout, self._ranks = clients, timeout, ranks
        # ranks this worker's receipted pushes go to (an in-process server confirms none)
        confirming = {ranks[k] for k, client in clients.items() if client.receipts}
        self.per_rank = 1 if len(confirming) > 1 else IN_FLIGHT
        # server rank -> its (shard, request) sent, not yet in
        self._unreceived: dict[int, deque[tuple[int, int]]] = {r: deque() for r in ranks}

    def wait_turn(self, k: int) -> None:
        """Before a push to shard ``k``: until fewer than ``per_rank`` pushes to its server
        rank are on their way."""
        waiting = self._unreceived[self._ranks[k]]
        while len(waiting) >= self.per_rank:
            j, seq = waiting.popleft()
            self._clients[j].wait_receipt(seq, self._timeout)

    def wants_receipt(self, k: int, data: dict[str, Any]) -> bool:
        """Does the push of ``data`` to shard ``k`` ask for a receipt?  Gradients of at least
        ``PACED_BYTES`` do, where the link confirms arrivals (a withheld push has none)."""
        grads = data.get("grads")
        if grads is None or not self._clients[k].receipts:
            return False
        return sum(g.numel() * g.element_size() for g in grads if g is not None) >= PACED_BYTES

    def sent(self, k: int, seq: int) -> None:
        """Request ``seq`` to shard ``k`` asked for a receipt: it counts until confirmed."""
        self._unreceived[self._ranks[k]].append((k, seq))

    def clear(self) -> None:
        """The step is over: its receipts are skipped by the next step's waits."""
        for waiting in self._unreceived.values():
            waiting.clear()
