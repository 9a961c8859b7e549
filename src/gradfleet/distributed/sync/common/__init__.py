"""What a SyncReplicas worker and its servers share, pure: the job's description (``job``), TF's
token queue (``tokens``), the non-finite check and policies (``finite``), a step's outcome
(``outcome``), and each update's R with what it is chosen from (``replicas_policy``,
``replica_choice``: the chief keeps them, or with no server every rank).  The worker, server
and layout folders import these and never each other's.

Layer: algorithms.
"""
