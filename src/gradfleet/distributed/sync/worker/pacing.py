"""Pacing: when a reading-ahead worker's next push may leave.

Why: sent all at once, a worker's pushes share its link and each arrives only at the end, so no
shard can update (and send its values back) before every gradient is out.  Paced, a worker's
pushes follow each other in :func:`~.shard_clients.push_order`, the shards update one after
another, and their values travel back while later gradients still go out, as BytePS schedules
its partitions with a credit of bytes.  Unlike waves (each sent once the last one's shards
answered), no push waits for another worker, and on the emulated cluster pacing is no slower
than waves.

The rule: a push of at least ``PACED_BYTES`` of gradients asks its server for a receipt, and
the next push leaves once fewer than ``IN_FLIGHT`` such pushes are unconfirmed (oldest first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from ...transport import MailboxClient

__all__ = ["IN_FLIGHT", "PACED_BYTES", "Pacing"]

IN_FLIGHT = 2  # pushes a worker has sent and their servers not yet received
# Smaller pushes are not paced: they cross a link in less time than a receipt costs the
# worker's and the server's threads, and the kernel's socket buffers take them whole anyway.
PACED_BYTES = 1 << 20


class Pacing:
    """One worker's pushes on their way to ``clients`` (shard -> its client), unconfirmed;
    ``timeout``: how long one receipt may take."""

    def __init__(self, clients: Mapping[int, MailboxClient], timeout: float) -> None:
        self._clients, self._timeout = clients, timeout
        self._unreceived: deque[tuple[int, int]] = deque()  # (shard, request) sent, not in

    def wait_turn(self) -> None:
        """Before the next push: until fewer than ``IN_FLIGHT`` pushes are on their way."""
        while len(self._unreceived) >= IN_FLIGHT:
            k, seq = self._unreceived.popleft()
            self._clients[k].wait_receipt(seq, self._timeout)

    def wants_receipt(self, k: int, data: dict[str, Any]) -> bool:
        """Does the push of ``data`` to shard ``k`` ask for a receipt?  Gradients of at least
        ``PACED_BYTES`` do, where the link confirms arrivals (a withheld push has none)."""
        grads = data.get("grads")
        if grads is None or not self._clients[k].receipts:
            return False
        return sum(g.numel() * g.element_size() for g in grads if g is not None) >= PACED_BYTES

    def sent(self, k: int, seq: int) -> None:
        """Request ``seq`` to shard ``k`` asked for a receipt: it counts until confirmed."""
        self._unreceived.append((k, seq))

    def clear(self) -> None:
        """The step is over: its receipts are skipped by the next step's waits."""
        self._unreceived.clear()
