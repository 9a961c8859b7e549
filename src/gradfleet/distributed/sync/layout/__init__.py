"""How the parameters are laid out over the SyncReplicas shards: whole or cut into pieces,
in which order, and each shard's values and gradients as views of the worker's tensors."""
