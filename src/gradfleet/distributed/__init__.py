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

Layers, lowest first; a module imports only from its own layer or lower ones
(``tests/distributed/test_layering.py`` checks it from the imports):

1. algorithms, no I/O -- state machines and pure helpers: ``sync.server.aggregator`` (TF's
   accumulators, staleness, tokens), ``sync.server.shards``, ``sync.server.chief`` and the
   chief's parts (the SyncReplicas servers), ``sync.layout.pieces``, ``easgd.centre_server``
   (the asynchronous centre), ``membership`` (which workers a server expects, saw leave,
   lost), ``replies`` (what a state machine returns: answers and effects), ``apply`` (apply
   gradients with any optimizer), ``flat``, ``moving_average``.
   They import neither ``torch.distributed`` nor the transport and are tested in one process.
2. communication -- ``transport/`` (request/reply on a c10d store for control, a gloo pair per
   client for tensors, the wire format), ``all_reduce`` (sums over a process group and the
   mean of the ranks' gradients, one rule for sparse rows), ``collectives`` (lists of tensors
   over a process group), ``process_group`` (:func:`init`).
3. hosting -- ``hosting`` (where a server listens, serving a state machine and performing its
   effects, publishing addresses, closing when every worker left), ``sync.server.servers``
   (the SyncReplicas servers of a rank), the worker's links in ``sync.worker``
   (``shard_clients``, ``plain_links``: TF's push, token, read; ``ahead_links``, ``pacing``,
   ``pending_step``, ``answer_taker``, ``early_pushes``, ``error_latch``, ``streaming``:
   reading ahead, paced pushes, the answers and overlap's pushes on threads, a step's reads
   waited on per shard, streamed reads), ``sync.layout.shard_layout`` (a worker's view of its
   parameters shard by shard), ``dedicated`` (what rank 0 tells the dedicated server ranks).
4. wrappers -- ``wrapper`` (the shared ``torch.optim.Optimizer`` base), ``sync.optimizer``
   and its exchanges (``sync.worker.server_exchange``, ``sync.worker.allreduce``),
   ``easgd.optimizer``, ``easgd.centre``, ``easgd.async_centre``, ``model_average``,
   ``towers``, ``replicate``, ``serving`` (a dedicated server rank).
5. jobs -- ``job_control`` (the per-worker launch recipe's environment, the job's store keys) and
   ``testing`` (multi-process test harness).

Every module logs its decisions (a dropped stale or non-finite gradient, a lost or forgotten
worker, an unreachable server, a fallback) on ``logging.getLogger(__name__)``.
"""

from .easgd import (
    CENTRE_MODES,
    AllReduceCentre,
    AsyncCentre,
    CentreStrategy,
    ElasticAverageOptimizer,
)
from .model_average import ModelAverageOptimizer
from .moving_average import ExponentialMovingAverage
from .process_group import COMBINED_BACKEND, DistInfo, init, shutdown
from .replicate import ReplicatedModel, TowerOutput, replicate_model, split_batch
from .serving import ParameterServer, serve
from .sync import AutoReplicas, Decision, ReplicasPolicy, SyncReplicasOptimizer
from .towers import TowerOptimizer, current_tower

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
