"""Weight sync from trainers to rollout nodes: publisher (trainer), inbox (rollout), tiers (movers)."""
from distflow.weights.inbox import BUCKET_BYTES, WeightInbox, WeightUpdate, buckets, tied_names
from distflow.weights.publisher import WeightPublisher

__all__ = ["BUCKET_BYTES", "WeightInbox", "WeightPublisher", "WeightUpdate", "buckets", "tied_names"]
