"""Distributed optimizer wrappers: TF 1.x semantics on ``torch.distributed``.

* :func:`init` -- bring up the process group from torchrun's environment (idempotent).
* :class:`ModelAverageOptimizer` -- local steps, exact model averaging every ``interval_steps``.
* :class:`ElasticAverageOptimizer` -- EASGD with an elastic penalty and a centre variable.
* :class:`TowerOptimizer` + :func:`replicate_model` -- one process, several devices.
* :class:`SyncReplicasOptimizer` -- synchronous SGD with backup workers and stale-gradient
  dropping on a server inside the job.
"""

from ._async_centre import AsyncCentre
from ._centre import AllReduceCentre, CentreStrategy
from ._launch import DistInfo, init, shutdown
from .elastic_average import ElasticAverageOptimizer
from .model_average import ModelAverageOptimizer
from .replicate import ReplicatedModel, TowerOutput, replicate_model, split_batch
from .sync_replicas import ExponentialMovingAverage, SyncReplicasOptimizer
from .towers import TowerOptimizer

__all__ = [
    "AllReduceCentre",
    "AsyncCentre",
    "CentreStrategy",
    "DistInfo",
    "ElasticAverageOptimizer",
    "ExponentialMovingAverage",
    "ModelAverageOptimizer",
    "ReplicatedModel",
    "TowerOptimizer",
    "TowerOutput",
    "init",
    "replicate_model",
    "shutdown",
    "split_batch",
    "SyncReplicasOptimizer",
]
