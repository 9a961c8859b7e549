"""``SyncReplicasOptimizer``: TF's synchronous replicas with a chief, parameter shards and tokens.

Three folders, and the wrapper on top:

* :mod:`.server` -- the servers' state machines, pure: TF's accumulators and token queue
  (``aggregator``), a shard and its server (``shards``, with ``read_ahead``'s answers), the
  chief (``chief``: shard 0's server plus ``global_step``, the ``token_line``, read-ahead's
  ``token_requests`` and each update's R, ``replica_choice`` over a ``replicas_policy``), and
  their hosting on a rank (``servers``);
* :mod:`.worker` -- a worker's side: the exchange through servers (``server_exchange``) or
  without one (``allreduce``), its links (``shard_clients`` under ``plain_links`` or
  ``ahead_links``, with ``pacing``, ``answer_taker``, ``early_pushes``), the ``pending_step``,
  and the policies over a step (``overlap``, ``streaming``, the ``error_latch``);
* :mod:`.layout` -- the parameters over the shards: whole or in ``pieces``, and the worker's
  ``shard_layout`` (each shard's values and gradients as views of its tensors);
* :mod:`.arguments`, :mod:`.outcome`, :mod:`.optimizer` -- the ``torch.optim.Optimizer``
  wrapper users construct: its checked arguments, the books (steps, counters,
  ``state_dict``) and one exchange, chosen once.
"""

from ..moving_average import ExponentialMovingAverage
from .optimizer import SyncReplicasOptimizer
from .server.replicas_policy import AutoReplicas, Decision, ReplicasPolicy

__all__ = [
    "AutoReplicas",
    "Decision",
    "ExponentialMovingAverage",
    "ReplicasPolicy",
    "SyncReplicasOptimizer",
]
