"""How the parameters are laid out over the SyncReplicas shards, every layout decision: which
ranks host which shards and which parameters each holds (``assignment``), whole or cut into
``pieces``, and the worker's one map of its parameters to the shards (``shard_layout``: each
shard's values and gradients as views of the worker's tensors).  Pure: no I/O.

Layer: algorithms.
"""
