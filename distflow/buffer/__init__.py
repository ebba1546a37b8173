"""Buffer: the per-node data shard, owner routing, and the distributed dataloader."""
