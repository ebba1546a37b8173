"""A GRPO advantage estimator that makes one trainer rank hang, once, for the hang tests
(tests/test_hang.py): named in a config as ``workflow.N.fn=tests.hang_fns:grpo_hanging_once``.

Why a workflow function: it runs where the trainer runs its own part of a step (the training
thread, between two stages' collectives), as a user's estimator or a stuck data path would, with
no test hook in the trainer. The first process life to reach ``hang_call`` on rank ``rank`` writes
``marker`` and sleeps; a restarted rank finds the marker and computes GRPO."""

from __future__ import annotations

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
