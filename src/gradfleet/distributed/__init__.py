"""Distributed optimizer wrappers: TF 1.x semantics on ``torch.distributed``.

* :func:`init` -- bring up the process group from torchrun's environment (idempotent).
* :class:`ModelAverageOptimizer` -- local steps, exact model averaging every ``interval_steps``.
* :class:`ElasticAverageOptimizer` -- EASGD with an elastic penalty and a centre variable.
* :class:`TowerOptimizer` + :func:`replicate_model` -- one process, several devices.
"""

from ._centre import AllReduceCentre, CentreStrategy
from ._launch import DistInfo, init, shutdown
from .elastic_average import ElasticAverageOptimizer
from .model_average import ModelAverageOptimizer
from .replicate import ReplicatedModel, TowerOutput, replicate_model, split_batch
from .towers import TowerOptimizer

__all__ = [
    "AllReduceCentre",
    "CentreStrategy",
    "DistInfo",
    "ElasticAverageOptimizer",
    "ModelAverageOptimizer",
    "ReplicatedModel",
    "TowerOptimizer",
    "TowerOutput",
    "init",
    "replicate_model",
    "shutdown",
    "split_batch",
]
