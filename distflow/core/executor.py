"""The mechanism both group executors share: a (role, type) -> stage registry and the
plan-order walk.

Why it exists: the rollout group (:mod:`distflow.rollout.stages`, also used by stage
workers) and the trainer group (:mod:`distflow.trainer.executor`) run their parts of a
workflow the same way — look up each node's stage by (role, type), run the nodes in plan
order, and refuse a node whose in-group deps have not run. Only what a stage takes and
returns differs, so the registry is generic and each executor keeps its own loop body.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, Iterator, TypeVar

from distflow.core.dag import WorkflowNode

__all__ = ["StageRegistry"]

S = TypeVar("S", bound=Callable)


class StageRegistry(Generic[S]):
    """Stages of one group. ``error`` is the exception type raised for a node that cannot run
    (its message names the node)."""

    def __init__(self, group: str, error: type[Exception] = RuntimeError):
        self.group, self.error = group, error
        self.stages: dict[tuple[str, str], S] = {}

    def register(self, role: str, type_: str) -> Callable[[S], S]:
        """Decorator: ``fn`` runs every workflow node of this (role, type) on this group."""
        def deco(fn: S) -> S:
            self.stages[(role, type_)] = fn
            return fn
        return deco

    def walk(self, pipeline: list[WorkflowNode], local: Iterable[str] | None = None
             ) -> Iterator[tuple[WorkflowNode, S]]:
        """Yield (node, stage) in plan order; the caller runs the stage before asking for the
        next. ``local``: the ids whose deps must have run first (default: the pipeline's own)."""
        local_ids = set(local) if local is not None else {n.id for n in pipeline}
        done: set[str] = set()
        for node in pipeline:
            missing = [d for d in node.deps if d in local_ids and d not in done]
            if missing:
                raise self.error(f"workflow node {node.id!r}: deps {missing} have not run on the {self.group} group "
                                 f"(pipeline out of plan order)")
            stage = self.stages.get((node.role.value, node.type.value))
            if stage is None:
                raise self.error(f"workflow node {node.id!r}: no {self.group} stage for "
                                 f"{node.role.value} {node.type.value}")
            yield node, stage
            done.add(node.id)
