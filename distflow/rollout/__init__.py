"""Rollout side: generation engines, reward functions and the rollout worker."""
