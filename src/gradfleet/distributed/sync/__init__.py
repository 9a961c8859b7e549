"""``SyncReplicasOptimizer``: TF's synchronous replicas with a chief, parameter shards and tokens.

Four folders, and the wrapper on top; the folders never reach across (``worker`` and
``layout`` import nothing from ``server``, ``server`` nothing from ``worker``):

* :mod:`.common` -- what every side shares, pure: the ``job`` (one frozen description of the
  job's arguments, travelling whole to every exchange and server), TF's token queue
  (``tokens``), the non-finite check and policies (``finite``), a step's ``outcome``;
* :mod:`.server` -- the servers' state machines, pure: TF's accumulators (``aggregator``), a
  shard and its server (``shards``, with ``read_ahead``'s answers), the chief (``chief``:
  shard 0's server plus ``global_step``, the ``token_line``, read-ahead's ``token_requests``
  and each update's R, ``replica_choice`` over a ``replicas_policy``); hosted on a rank by
  :mod:`gradfleet.distributed.hosting.sync_servers`;
* :mod:`.worker` -- a worker's side: the exchange without a server (``allreduce``), its links
  to servers (``shard_clients`` under ``plain_links`` or ``ahead_links``, with ``pacing``,
  ``answer_taker``, ``early_pushes``), the ``pending_step``, and the policies over a step
  (``overlap``, ``streaming``, the ``error_latch``);
* :mod:`.layout` -- every layout decision: which ranks host which shards and which parameters
  each holds (``assignment``), whole or in ``pieces``, and the worker's one map of its
  parameters to the shards (``shard_layout``);
* :mod:`.exchange` (the :class:`~.exchange.Exchange` protocol every exchange implements),
  :mod:`.server_exchange` (the exchange through servers: layout, hosted servers and the
  worker's links joined), :mod:`.arguments`, :mod:`.optimizer` -- the
  ``torch.optim.Optimizer`` wrapper users construct: its checked arguments, the books (steps,
  counters, ``state_dict``) and one exchange, chosen once.

Layer: wrappers.
"""

from ..common.moving_average import ExponentialMovingAverage
from .common.replicas_policy import AutoReplicas, Decision, ReplicasPolicy
from .optimizer import SyncReplicasOptimizer

__all__ = [
    "AutoReplicas",
    "Decision",
    "ExponentialMovingAverage",
    "ReplicasPolicy",
    "SyncReplicasOptimizer",
]
