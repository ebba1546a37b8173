"""Core: identity, mesh membership, wire format, tensor channels, DAG planner, config.

`core` imports nothing from `rollout`, `trainer` or `buffer`.
"""
