"""The job: what every part of a SyncReplicas job knows of it, in one frozen value.

``SyncReplicasOptimizer`` checks its arguments once (:mod:`.arguments`) and builds one
:class:`Job`; the same value travels whole to the exchange it chose, to the servers it hosts
(:class:`~.server.servers.SyncServers`, the chief :class:`~.server.chief.SyncChief` and the
shards), and -- inside the spec rank 0 announces -- to the dedicated server ranks
(:mod:`gradfleet.distributed.hosting.serving`).  No layer lists the options again.

Names, as the optimizer's arguments have them: ``tokens`` is the token *rule*
(``"distinct"``: one gradient per worker per update; ``"shared"``: TF's ``sync_token_q``), and
``initial_tokens`` the shared queue's first tokens (TF's ``num_tokens``, resolved: ``-1`` is R).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types only: the job is plain data, read by every folder
    from ...common.moving_average import ExponentialMovingAverage
    from .replicas_policy import ReplicasPolicy

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    """A SyncReplicas job's checked arguments (module docstring).

    ``R``: gradients per update (``replicas_to_aggregate``; where a ``policy`` chooses each
    update's R, the first update's); ``N``: workers (``total_num_replicas``); ``tokens``: the
    token rule; ``initial_tokens``: the shared rule's first tokens; ``timeout``: seconds a
    worker waits for a token or a server; ``nonfinite``: ``"raise"``, ``"drop"`` or
    ``"apply"``; ``last_step``: the step that releases every worker; ``ema`` and ``averaged``:
    ``variable_averages`` and the parameter indices it tracks; ``global_step``: the step the
    job starts from; ``policy``: chooses each update's R (``replicas_to_aggregate="auto"``);
    ``max_losses``: workers the all-reduce exchange may lose and go on without (0: a loss
    ends the job); ``hear_every_worker``: backups without a server wait briefly for a worker
    left out of many updates (:mod:`..worker.deference`); ``standby``: a live copy of the
    chief on another rank (``True``: chosen for the job; a rank; ``False``: none), see
    :func:`..arguments.check_standby`."""

    R: int
    N: int
    tokens: str = "distinct"
    initial_tokens: int = 0
    timeout: float = 60.0
    nonfinite: str = "raise"
    last_step: int | None = None
    ema: ExponentialMovingAverage | None = None
    averaged: tuple[int, ...] = ()
    global_step: int = 0
    policy: ReplicasPolicy | None = None
    max_losses: int = 0
    hear_every_worker: bool = True
    standby: int | bool = False

    @property
    def tokens_per_update(self) -> int:
        """Tokens the shared queue gets after every update (TF: ``max(N, R)``)."""
        return max(self.N, self.R)
