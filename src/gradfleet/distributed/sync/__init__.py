"""``SyncReplicasOptimizer``: TF's synchronous replicas with a chief, parameter shards and tokens.

Modules, from the algorithm to the wrapper:

* :mod:`.aggregator` -- TF's conditional accumulators (staleness rule) and token queue;
* :mod:`.token_line` -- which waiting worker gets its next step (one gradient per worker per
  update, or TF's shared queue), and when the live workers can never make an update;
* :mod:`.shards` -- a shard's variables, their accumulators and optimizer copy; the shard
  server's state machine; how parameters are assigned to shards;
* :mod:`.pieces` -- ``shard_assignment="split"``: large parameters cut into contiguous
  pieces, the elementwise rule for the wrapped optimizer, its copy over the pieces;
* :mod:`.chief` -- the chief's state machine: shard 0, ``global_step``, the tokens;
* :mod:`.servers` -- hosting the chief and shards of one rank (reports, probes, close);
* :mod:`.links` -- a worker's connections: push, token, read;
* :mod:`.allreduce` -- the exchange without a server (R == N): DDP-style buckets overlapped
  with backward, the same numbers;
* :mod:`.overlap` -- ``overlap=True`` with servers: which shards backward has completed;
* :mod:`.streaming` -- streamed reads: each module's forward waits for its own shards;
* :mod:`.layout` -- the parameters seen shard by shard (pieces, views);
* :mod:`.server_exchange` -- the exchange through servers, complete in itself: layout, hosted
  servers, links, and the overlap and streamed-reads policies over a step;
* :mod:`.outcome` -- what a step of either exchange tells the optimizer's books;
* :mod:`.optimizer` -- the ``torch.optim.Optimizer`` wrapper users construct: the books
  (steps, counters, ``state_dict``) and one exchange, chosen once.
"""

from ..moving_average import ExponentialMovingAverage
from .optimizer import SyncReplicasOptimizer

__all__ = ["ExponentialMovingAverage", "SyncReplicasOptimizer"]
