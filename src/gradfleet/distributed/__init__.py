"""Distributed optimizer wrappers: TF 1.x semantics on ``torch.distributed``.

* :func:`init` -- bring up the process group from torchrun's environment (idempotent).
* :class:`ModelAverageOptimizer` -- local steps, exact model averaging every ``interval_steps``.
* :class:`ElasticAverageOptimizer` -- EASGD with an elastic penalty and a centre variable.
* :class:`TowerOptimizer` + :func:`replicate_model` -- one process, several devices.
* :class:`SyncReplicasOptimizer` -- synchronous SGD with backup workers and stale-gradient
  dropping on a server inside the job.

Layers of the server-based wrappers, from ``SyncReplicasOptimizer.step`` to the wire:

1. wrappers -- ``sync_replicas.py`` (``step`` -> ``_server_step``: push, token, read) and
   ``elastic_average.py`` with ``_async_centre.AsyncCentre`` (``exchange``); they call
   ``MailboxClient.call(op, **fields)`` with tensors among the fields;
2. algorithms, no I/O -- ``_aggregator.py`` (TF's accumulators, staleness, tokens),
   ``_server.py`` ``SyncServer`` (PS + chief sync op), ``_shards.py`` ``Shard``/``ShardServer``,
   ``_async_centre.CentreServer`` (the centre rule); each is ``handle(msg, reply)`` on plain
   dicts of numbers and tensors, testable in one process with a fake reply;
3. ``transport/`` -- ``mailbox.py`` request/reply (control JSON on the server's c10d
   ``TCPStore``), ``wire.py`` (message = JSON + packed/direct tensor buffers, no pickling),
   ``pairs.py`` (the data plane: a 2-rank gloo process group per server and client incarnation,
   or an in-process ``LocalLink`` for the worker that shares the server's process).
"""

from ._async_centre import AsyncCentre
from ._centre import CENTRE_MODES, AllReduceCentre, CentreStrategy
from ._launch import COMBINED_BACKEND, DistInfo, init, shutdown
from .elastic_average import ElasticAverageOptimizer
from .model_average import ModelAverageOptimizer
from .replicate import ReplicatedModel, TowerOutput, replicate_model, split_batch
from .sync_replicas import ExponentialMovingAverage, SyncReplicasOptimizer
from .towers import TowerOptimizer, current_tower

__all__ = [
    "AllReduceCentre",
    "CENTRE_MODES",
    "COMBINED_BACKEND",
    "AsyncCentre",
    "CentreStrategy",
    "DistInfo",
    "ElasticAverageOptimizer",
    "ExponentialMovingAverage",
    "ModelAverageOptimizer",
    "ReplicatedModel",
    "current_tower",
    "TowerOptimizer",
    "TowerOutput",
    "init",
    "replicate_model",
    "shutdown",
    "split_batch",
    "SyncReplicasOptimizer",
]
