"""Distributed optimizer wrappers: TF 1.x semantics on ``torch.distributed``.

* :func:`init` -- bring up the process group from torchrun's environment (idempotent).
* :class:`ModelAverageOptimizer` -- local steps, exact model averaging every ``interval_steps``.
* :class:`ElasticAverageOptimizer` -- EASGD with an elastic penalty and a centre variable
  (synchronous all-reduce centre, or :class:`AsyncCentre` on a server rank).
* :class:`TowerOptimizer` + :func:`replicate_model` -- one process, several devices.
* :class:`SyncReplicasOptimizer` -- synchronous SGD with backup workers and stale-gradient
  dropping on servers inside the job (one chief, optionally parameter shards).
* :func:`serve` / :class:`ParameterServer` -- a rank that only serves (TF's ps task): the
  SyncReplicas servers or the asynchronous EASGD centre on ranks outside the workers.

Folders by concept: ``wrappers/`` (model averaging, towers), ``sync/`` (SyncReplicas),
``easgd/`` (EASGD), ``hosting/`` (where servers run), ``transport/`` (how bytes travel),
``common/`` (pure pieces they share).  Each folder belongs to one layer -- algorithms (no I/O),
communication, hosting, wrappers, jobs (this package: ``job_control``, ``testing``) -- and says
which in its docstring; a module imports only from its own layer or lower ones
(``docs/distributed-design.md``; ``tests/distributed/test_layering.py`` checks it).

Every module logs its decisions (a dropped stale or non-finite gradient, a lost or forgotten
worker, an unreachable server, a fallback) on ``logging.getLogger(__name__)``.

Layer: jobs.
"""

from .common.moving_average import ExponentialMovingAverage
from .easgd import (
    CENTRE_MODES,
    AllReduceCentre,
    AsyncCentre,
    CentreStrategy,
    ElasticAverageOptimizer,
)
from .hosting.serving import ParameterServer, serve
from .sync import AutoReplicas, Decision, ReplicasPolicy, SyncReplicasOptimizer
from .transport.process_group import COMBINED_BACKEND, DistInfo, init, shutdown
from .wrappers.model_average import ModelAverageOptimizer
from .wrappers.replicate import ReplicatedModel, TowerOutput, replicate_model, split_batch
from .wrappers.towers import TowerOptimizer, current_tower

__all__ = [
    "AllReduceCentre",
    "AutoReplicas",
    "Decision",
    "ReplicasPolicy",
    "AsyncCentre",
    "CENTRE_MODES",
    "CentreStrategy",
    "COMBINED_BACKEND",
    "current_tower",
    "DistInfo",
    "ElasticAverageOptimizer",
    "ExponentialMovingAverage",
    "init",
    "ModelAverageOptimizer",
    "ParameterServer",
    "replicate_model",
    "ReplicatedModel",
    "serve",
    "shutdown",
    "split_batch",
    "SyncReplicasOptimizer",
    "TowerOptimizer",
    "TowerOutput",
]
