"""Where servers run: a state machine served on a rank and its addresses (``hosted_server``),
the SyncReplicas servers of one rank (``sync_servers``), what rank 0 tells the dedicated server
ranks (``dedicated``) and a rank that only serves (``serving``: :func:`serve`), and closing
wrappers a program left open at the interpreter's exit (``closing``).

Layer: hosting.
"""
