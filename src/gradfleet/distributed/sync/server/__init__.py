"""The SyncReplicas servers: a shard's state machine (variables, accumulators, read-ahead
answers), the chief's (shard 0 plus ``global_step``, the token line, the order of read-ahead
requests and each update's R), and hosting them on a rank.  Everything but :mod:`.servers` is
pure: no I/O."""
