"""What one SyncReplicas step tells the optimizer's books, whichever exchange made it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Outcome"]


@dataclass(frozen=True)
class Outcome:
    """Was this worker's gradient used (None: not known until the step's streamed reads are
    in, then the exchange's ``settle`` says), its next ``local_step`` and the ``global_step``
    it has seen."""

    accepted: bool | None
    local_step: int
    global_step: int
