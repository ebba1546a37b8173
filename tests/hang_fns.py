"""A GRPO advantage estimator and a policy loss that make one trainer rank hang, once, for the hang tests
(tests/test_hang.py): named in a config as ``workflow.N.fn=tests.hang_fns:grpo_hanging_once``.

Why a workflow function: it runs where the trainer runs its own part of a step (the training
thread, between two stages' collectives), as a user's estimator or a stuck data path would, with
no test hook in the trainer. The first process life to reach ``hang_call`` on rank ``rank`` writes
``marker`` and sleeps; a restarted rank finds the marker and computes GRPO."""

from __future__ import annotations

import os
import time

_calls: dict[str, int] = {}  # calls of each function in this process life


def _hang_once(fn: str, hang_call: int, rank: int, marker: str, inside: bool = False) -> None:
    """On rank ``rank``, at the ``hang_call``-th call of ``fn``, in the first process life to get there
    (no ``marker`` yet): write ``marker`` (pid, time) and sleep, the rank's event loop still answering
    the mesh; ``inside``: in a collective it entered (counted, never left), as a hung kernel."""
    import torch.distributed as dist

    _calls[fn] = _calls.get(fn, 0) + 1
    if dist.get_rank() != rank or _calls[fn] != hang_call or os.path.exists(marker):
        return
    with open(marker, "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
    if inside:
        from distflow.trainer.collectives import counted

        counted("all_reduce", time.sleep, 3600)
    time.sleep(3600)


def grpo_hanging_once(rewards, group_ids, marker: str, hang_call: int = 3, rank: int = 1, **args):
    from distflow.rl.registry import ADVANTAGE_ESTIMATORS

    _hang_once("advantage", hang_call, rank, marker)
    return ADVANTAGE_ESTIMATORS["grpo"](rewards, group_ids, **args)


def loss_hanging_once(*args, **kwargs):
    """The GRPO policy loss, except that rank 1 hangs in its ``HANG_LOSS_CALL``-th call (default 3) when
    ``HANG_MARKER`` (a path in the environment) does not exist yet: it writes it and sleeps. That is a
    hang between two of the model's collectives: the forward's all-gathers are behind, the backward's
    ahead, and the other rank goes on into them and waits there, in the same stage. With ``HANG_INSIDE``
    set it sleeps inside a collective it entered (as a rank whose collective kernel hangs): both ranks
    are then in their collective of the same index, and neither completes."""
    from distflow.rl.registry import POLICY_LOSSES

    _hang_once("loss", int(os.environ.get("HANG_LOSS_CALL", "3")), 1, os.environ["HANG_MARKER"],
               inside=bool(os.environ.get("HANG_INSIDE")))
    return POLICY_LOSSES["grpo"](*args, **kwargs)  # (it takes every keyword the trainer passes: **shared)
