"""Core: identity, mesh membership, wire format, authentication, DAG planner, config.

`core` imports nothing from `rollout`, `trainer` or `buffer`.
"""
