"""``SyncReplicasOptimizer``: TF's synchronous replicas with a chief, parameter shards and tokens.

Modules, from the algorithm to the wrapper:

* :mod:`.aggregator` -- TF's conditional accumulators (staleness rule) and token queue;
* :mod:`.shards` -- a shard's variables, their accumulators and optimizer copy; the shard
  server's state machine; how parameters are assigned to shards;
* :mod:`.pieces` -- ``shard_assignment="split"``: large parameters cut into contiguous
  pieces, the elementwise rule for the wrapped optimizer, its copy over the pieces;
* :mod:`.chief` -- the chief's state machine: shard 0, ``global_step``, the tokens;
* :mod:`.servers` -- hosting the chief and shards of one rank (reports, probes, close);
* :mod:`.links` -- a worker's connections: push, token, read;
* :mod:`.lockstep` -- ``transport="allreduce"``: the same numbers without a server;
* :mod:`.overlap` -- ``overlap=True``: shards pushed from backward's gradient hooks;
* :mod:`.checkpoint`, :mod:`.queries`, :mod:`.shard_views` -- the wrapper's ``state_dict``,
  its questions to the servers, and its parameters seen shard by shard (mixins of the
  optimizer);
* :mod:`.optimizer` -- the ``torch.optim.Optimizer`` wrapper users construct.
"""

from ..moving_average import ExponentialMovingAverage
from .optimizer import SyncReplicasOptimizer

__all__ = ["ExponentialMovingAverage", "SyncReplicasOptimizer"]
