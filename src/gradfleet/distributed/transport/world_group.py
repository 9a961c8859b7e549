"""The job's process group as a group that never changes: the all-reduce exchange's members
when no loss is allowed (every rank, in rank order; a lost one fails every collective).

Its calls are those of :class:`.elastic_group.ElasticGroup`, so the exchange is written once
over either."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .all_reduce import collective_device
from .errors import gloo_link

__all__ = ["WorldGroup"]

_PEER = "a peer of the all-reduce"


class WorldGroup:
    """``torch.distributed``'s default group (or this process alone, without one)."""

    joiners_waiting = False
    continuing = True  # never a new generation

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if on else 0
        self.members = list(range(dist.get_world_size() if on else 1))
        self.generation = 0
        self.device = collective_device()  # where its collectives take small tensors

    @property
    def index(self) -> int:
        return self.rank

    @property
    def size(self) -> int:
        return len(self.members)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Any:
        with gloo_link(_PEER, "all_reduce"):
            return dist.all_reduce(tensor, async_op=async_op)

    def wait(self, work: Any) -> None:
        """Until ``work`` is done (a send: until its peer received it), at most ``timeout``
        seconds if this group was given one (else the process group's)."""
        with gloo_link(_PEER, "wait"):
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=self.timeout))

    def hold(self, work: Any) -> Any:
        """A work of another group among the members, to be waited for with :meth:`wait`."""
        return work

    def watcher(self) -> Callable[[], str | None]:
        """Nothing to watch: a lost member fails the collectives."""
        return lambda: None

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        with gloo_link(f"rank {dst}", "send"):
            return dist.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        with gloo_link(f"rank {src}", "recv"):
            return dist.irecv(tensor, src)

    def reforming(self) -> str | None:
        """Never: its members never change."""
        return None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        with gloo_link(_PEER, "broadcast"):
            dist.broadcast(tensor, src=src)

    def close(self) -> None:
        """The default group belongs to the program."""
