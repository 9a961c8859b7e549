"""Where the EASGD centre variable lives: pluggable strategies behind ``ElasticAverageOptimizer``.

A strategy owns the centre ``c`` (TF's ``global_center_variable``) and performs one elastic
exchange for the calling worker.  :class:`AllReduceCentre` (``mode="allreduce"``) is the
synchronous form of the EASGD paper with the centre replicated on every rank;
:class:`~.async_centre.AsyncCentre` (``mode="async"``) keeps it on a server, TF's form.
``CENTRE_MODES`` maps each ``mode`` name to its class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..transport.collectives import Collective, resolve_collective

__all__ = ["CentreStrategy", "AllReduceCentre", "CENTRE_MODES"]


class CentreStrategy:
    """Interface of a centre backend, called by ``ElasticAverageOptimizer`` in this order:

    1. ``resolve_collective(num_worker, group, owner)``: the collective of the workers;
    2. ``configure(num_worker, synchronous)``: the wrapper's arguments the strategy needs;
    3. ``setup(params, comm)``, once and collectively: leave ``params`` equal to the initial
       centre (TF's ``get_init_op``);
    4. ``exchange(params, moving_rate)`` every ``communication_period`` local steps: one
       communication of this worker, returning the centre value it read *before* updating it
       (TF's ``local_center_variable`` after the exchange);
    5. ``close()`` at the end of training.
    """

    #: the name under which ``ElasticAverageOptimizer(mode=...)`` selects the strategy
    mode: str = ""

    def resolve_collective(self, num_worker: int, group: Any, owner: str) -> Collective:
        """The collective of ``num_worker`` workers in ``group`` (default: the process
        group's, checked against ``num_worker``)."""
        return resolve_collective(num_worker, group, owner)

    def configure(self, num_worker: int, synchronous: bool) -> None:
        """Take the wrapper's ``num_worker`` and ``synchronous`` (TF's start-up barrier flag);
        the default needs neither."""

    def global_step_increment(self) -> int:
        """How much ``global_step`` advances per exchange (TF: one per worker communication)."""
        raise NotImplementedError

    def setup(self, params: Sequence[torch.Tensor], comm: Collective) -> None:
        raise NotImplementedError

    def exchange(self, params: Sequence[torch.Tensor], moving_rate: float) -> list[torch.Tensor]:
        raise NotImplementedError

    def centre(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the strategy holds (threads, connections); the default holds none."""


class AllReduceCentre(CentreStrategy):
    """Synchronous EASGD (Zhang, Choromanska, LeCun 2015, eq. 5-6), centre on every rank.

    Every worker, at the same local step::

        d_i = x_i - c
        x_i := x_i - alpha * d_i
        c   := c + alpha * sum_j d_j       # one all-reduce of the elastic differences

    With one worker this is exactly TF's asynchronous update; with several it is the order-free
    synchronous form (TF's asynchronous result depends on which worker reaches the server first).
    """

    mode = "allreduce"

    def __init__(self) -> None:
        self._comm: Collective | None = None
        self._centre: list[torch.Tensor] = []

    def global_step_increment(self) -> int:
        assert self._comm is not None
        return self._comm.world_size

    def setup(self, params: Sequence[torch.Tensor], comm: Collective) -> None:
        self._comm = comm
        with torch.no_grad():
            comm.broadcast_([p.data for p in params], src=0)
            self._centre = [p.detach().clone() for p in params]

    def exchange(self, params: Sequence[torch.Tensor], moving_rate: float) -> list[torch.Tensor]:
        assert self._comm is not None, "setup() must run first"
        with torch.no_grad():
            read = [c.clone() for c in self._centre]
            diffs = [p.detach() - c for p, c in zip(params, read, strict=True)]
            for p, d in zip(params, diffs, strict=True):
                p.data.sub_(d, alpha=moving_rate)
            self._comm.all_reduce_sum_(diffs)
            for c, d in zip(self._centre, diffs, strict=True):
                c.add_(d, alpha=moving_rate)
        return read

    def centre(self) -> list[torch.Tensor]:
        return self._centre

    def state_dict(self) -> dict[str, Any]:
        return {"centre": [c.clone() for c in self._centre]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = state["centre"]
        if len(values) != len(self._centre) or any(
            v.shape != c.shape for v, c in zip(values, self._centre, strict=False)
        ):
            raise ValueError("ElasticAverageOptimizer.load_state_dict: centre shapes differ")
        with torch.no_grad():
            for c, v in zip(self._centre, values, strict=True):
                c.copy_(v)


#: ``mode`` name -> strategy class (``async_centre`` adds ``"async"``).
CENTRE_MODES: dict[str, type[CentreStrategy]] = {AllReduceCentre.mode: AllReduceCentre}
