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
* :mod:`.shard_clients` -- a worker's clients of the shards: hello, versions, what a push
  carries, push order, reads, queries, leaving;
* :mod:`.plain_links` -- TF's protocol over them (one server; a bad-input step): push, token,
  read in sequence;
* :mod:`.ahead_links` -- reading ahead (several shards): paced pushes, the token request alone,
  the answers taken on a thread (:mod:`.answer_taker`), overlap's pushes on a thread
  (:mod:`.early_pushes`); :mod:`.pacing` -- when the next push leaves;
* :mod:`.pending_step` -- a step whose token is in, its shards' values waited on per shard;
* :mod:`.error_latch` -- the worker's threads' errors, raised at the step boundary;
* :mod:`.allreduce` -- the exchange without a server (R == N): DDP-style buckets overlapped
  with backward, the same numbers;
* :mod:`.overlap` -- ``overlap=True`` with servers: which shards backward has completed;
* :mod:`.streaming` -- streamed reads: each module's forward waits for its own shards of the
  pending step;
* :mod:`.layout` -- the parameters seen shard by shard (pieces, views);
* :mod:`.server_exchange` -- the exchange through servers, complete in itself: layout, hosted
  servers, links (chosen once), the pending step, and the overlap and streamed-reads policies
  over it;
* :mod:`.outcome` -- what a step of either exchange tells the optimizer's books;
* :mod:`.optimizer` -- the ``torch.optim.Optimizer`` wrapper users construct: the books
  (steps, counters, ``state_dict``) and one exchange, chosen once.
"""

from ..moving_average import ExponentialMovingAverage
from .optimizer import SyncReplicasOptimizer

__all__ = ["ExponentialMovingAverage", "SyncReplicasOptimizer"]
