"""The wrappers that need no server: the shared ``torch.optim.Optimizer`` base (``wrapper``),
model averaging (``model_average``), towers in one process (``towers``, over ``replicate``'s
model copies).  SyncReplicas (``..sync``) and EASGD (``..easgd``) have folders of their own.

Layer: wrappers.
"""
