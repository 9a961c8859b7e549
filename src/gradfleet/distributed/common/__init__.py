"""Pure pieces the wrappers and servers share, no I/O: applying gradients with any optimizer
(``apply``), lists of tensors as flat buffers (``flat``), which workers a server expects, saw
leave or lost (``membership``), who is in a group's next generation (``quorum``), TF's moving
averages (``moving_average``) and what a server's state machine returns (``replies``: answers
and effects).

Layer: algorithms.
"""
