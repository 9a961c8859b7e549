"""The SyncReplicas servers' state machines, pure: a shard's (variables, accumulators,
read-ahead answers) and the chief's (shard 0 plus ``global_step``, the token line, the order of
read-ahead requests and each update's R, chosen by a replicas policy).  Hosting them on a rank
is :mod:`gradfleet.distributed.hosting.sync_servers`.

Layer: algorithms.
"""
