"""What a SyncReplicas worker and its servers share, pure: the job's description (``job``), TF's
token queue (``tokens``), the non-finite check and policies (``finite``) and a step's outcome
(``outcome``).  The worker, server and layout folders import these and never each other's.

Layer: algorithms.
"""
