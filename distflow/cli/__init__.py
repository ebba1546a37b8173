"""Old home of the entry points (now :mod:`distflow.launch.cli`): ``python -m distflow.cli`` still works."""

from distflow.launch.cli import main, node_main

__all__ = ["main", "node_main"]
