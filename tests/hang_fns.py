"""A GRPO advantage estimator and a policy loss that make one trainer rank hang, once, for the hang tests
(tests/test_hang.py): named in a config as ``workflow.N.fn=tests.hang_fns:grpo_hanging_once``.

Why a workflow function: it runs where the trainer runs its own part of a step (the training
thread, between two stages' collectives), as a user's estimator or a stuck data path would, with
no test hook in the trainer. The first process life to reach ``hang_call`` on rank ``rank`` writes
``marker`` and sleeps; a restarted rank finds the marker and computes GRPO."""

from __future__ import annotations

import inspect
import os
import time

_calls = 0


def grpo_hanging_once(rewards, group_ids, marker: str, hang_call: int = 3, rank: int = 1, **args):
    import torch.distributed as dist

    from distflow.rl.registry import ADVANTAGE_ESTIMATORS

    global _calls
    _calls += 1
    if dist.get_rank() == rank and _calls == hang_call and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"{os.getpid()} {time.time()}")
        time.sleep(3600)  # the hang: the rank's event loop still answers the mesh
    return ADVANTAGE_ESTIMATORS["grpo"](rewards, group_ids, **args)


_loss_calls = 0


def loss_hanging_once(*args, **kwargs):
    """The GRPO policy loss, except that rank 1 hangs in its ``HANG_LOSS_CALL``-th call (default 3) when
    ``HANG_MARKER`` (a path in the environment) does not exist yet: it writes it and sleeps. That is a
    hang between two of the model's collectives: the forward's all-gathers are behind, the backward's
    ahead, and the other rank goes on into them and waits there, in the same stage. With ``HANG_INSIDE``
    set it sleeps inside a collective it entered (as a rank whose collective kernel hangs): both ranks
    are then in their collective of the same index, and neither completes."""
    import torch.distributed as dist

    from distflow.rl.registry import POLICY_LOSSES

    global _loss_calls
    _loss_calls += 1
    marker = os.environ["HANG_MARKER"]
    if dist.get_rank() == 1 and _loss_calls == int(os.environ.get("HANG_LOSS_CALL", "3")) and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"{os.getpid()} {time.time()}")
        if os.environ.get("HANG_INSIDE"):  # inside a collective: entered (counted), never left, as a hung kernel
            from distflow.trainer.collectives import counted

            counted("all_reduce", time.sleep, 3600)
        time.sleep(3600)
    loss = POLICY_LOSSES["grpo"]
    takes = inspect.signature(loss).parameters  # (the trainer calls a loss with the keywords it takes)
    return loss(*args, **{k: v for k, v in kwargs.items() if k in takes})
