"""The exchange: what ``SyncReplicasOptimizer`` asks of the way its gradients travel.

The optimizer keeps the books (``local_step``, ``global_step``, the counters) and owns one
exchange, chosen once at construction; every exchange implements :class:`Exchange`:

* :class:`~.worker.allreduce.AllReduceExchange` -- R == N workers all-reduce, each rank keeping
  a replica of the server's state;
* :class:`~.server_exchange.ServerExchange` -- pushes to the chief, or to shards over several
  ranks, and reads the variables back.

A step is ``step(local_step, grads)``: push the gradients computed at ``local_step``, take the
next token, and leave the current variables in the parameters (with streamed reads, the
values of the last step may still be coming in; the next step, or the next forward of a
module holding them, waits for them: :meth:`Exchange.wait_reads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .common.outcome import Outcome

__all__ = ["Exchange", "Grads"]

Grads = list[torch.Tensor | None]


class Exchange(Protocol):
    """One worker's side of a SyncReplicas job (module docstring)."""

    #: the step this worker starts from (TF's ``local_step_init_op``)
    start_step: int
    #: the servers' ``"host:port"`` addresses, shard by shard (none without a server)
    server_addresses: list[str]
    server_address: str | None
    #: does this rank host the chief?
    is_chief: bool
    #: ranks that only serve (dedicated servers)
    dedicated: list[int]

    # ------------------------------------------------------------------ the step
    def step(self, local_step: int, grads: Grads, stream: bool = True) -> Outcome:
        """Push ``grads`` tagged ``local_step``, take a token, read the variables.  Waits
        first for the last step's streamed reads.  ``stream=False``: this step's reads are
        loaded before it returns (TF's ``apply_gradients``), even where reads stream."""
        ...

    def check_own_gradients(self) -> None:
        """``apply_gradients`` brings gradients of its own: refuse where backward already
        sent some from ``.grad``."""
        ...

    # ------------------------------------------------------------------ streamed reads
    def stream_reads(self, model: torch.nn.Module) -> None: ...

    def wait_reads(self) -> None:
        """Until every value of the last step is loaded and its verdict recorded."""
        ...

    @property
    def streaming(self) -> bool:
        """Does ``step()`` leave the reads to the next forward?"""
        ...

    @property
    def reads_pending(self) -> bool:
        """Are values of the last step still coming in?"""
        ...

    # ------------------------------------------------------------------ questions
    def replicas_history(self) -> list[int]: ...

    def worker_counters(self, shard: int = 0) -> dict[int, dict[str, int]]: ...

    def averaged_variables(self) -> list[torch.Tensor | None]: ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def withheld_pushes(self) -> int: ...

    def worker_silence(self) -> dict[int, float]: ...

    def forget_workers(self, ranks: Sequence[int]) -> None: ...

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The exchange's part of this rank's checkpoint."""
        ...

    def check_state(self, counters: dict[str, Any]) -> None:
        """Refuse a checkpoint of another exchange or layout (before anything is loaded)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def applied_state(self) -> tuple[Any, dict[int, Any], int] | None:
        """``(optimizer, {parameter index: variable}, global_step)`` of the state the
        updates are applied with on this rank, or None where this rank holds none."""
        ...

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None: ...
