"""A SyncReplicas worker's side: its two exchanges (through servers, or an all-reduce without
one), the links to the servers (plain, or reading ahead over paced pushes), the pending step,
and the policies over a step (overlap with backward, streamed reads, the error latch)."""
