"""Where the EASGD centre variable lives: pluggable strategies behind ``ElasticAverageOptimizer``.

A strategy owns the centre ``c`` (TF's ``global_center_variable``) and performs one elastic
exchange for the calling worker. This release ships :class:`AllReduceCentre`, the synchronous form
of the EASGD paper with the centre replicated on every rank; an asynchronous parameter-server
strategy can be added later under another ``mode`` name without changing the wrapper's API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._comm import Collective

__all__ = ["CentreStrategy", "AllReduceCentre", "CENTRE_MODES"]


class CentreStrategy:
    """Interface of a centre backend.

    ``setup(params)`` is called once (collectively) by the wrapper and must leave ``params`` equal
    to the initial centre (TF's ``get_init_op``). ``exchange(params, moving_rate)`` performs one
    communication for this worker and returns the centre value it read *before* updating it
    (TF's ``local_center_variable`` after the exchange).
    """

    #: the name under which ``ElasticAverageOptimizer(mode=...)`` selects the strategy
    mode: str = ""

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


#: ``mode`` name -> strategy factory; part 2 registers the asynchronous server here.
CENTRE_MODES: dict[str, type[CentreStrategy]] = {AllReduceCentre.mode: AllReduceCentre}
