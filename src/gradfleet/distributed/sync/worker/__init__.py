"""A SyncReplicas worker's side: the all-reduce exchange (no server), the links to the
servers (plain, or reading ahead over paced pushes), the pending step, and the policies over a
step (overlap with backward, streamed reads, the error latch).  Nothing here imports
:mod:`..server`: what both sides need is in :mod:`..common`.

Layer: hosting.
"""
