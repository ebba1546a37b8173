"""DistFlow: fully distributed RL for LLM post-training.

No process is a driver: every node runs its own controller loop, reads its own shard
of the prompts, and moves data straight to the peers that need it.
"""

__version__ = "0.1.0"
