"""One trainer replica group (one rank) for tests/test_replicas.py: a process of its own, so a
test can SIGKILL it and start it again.

Why a small model and not a distflow cluster: the final weights can be compared with a single
process's exactly (a share lost or trained twice changes them), which a run's loss (each share's
token mean) does not allow; ``distflow run`` with ``trainer_replicas`` has its own test. What this
exercises is the mechanism the run uses, with real parts only: a gossip mesh node (where the lighthouse is found), torchft's lighthouse, manager and
gloo process group (distflow.trainer.replicas), and a torch model with its optimizer.

Each step's samples are a function of the step (:func:`step_samples`); a replica trains its share
with a loss scaled so that the gradient averaged over the quorum is the mean over the whole step
whoever takes part (:func:`share_loss`): the final weights equal a single-process run of every step
over every sample (:func:`reference_weights`) exactly when every sample was trained once a step.

    python -m tests.replica_child OUT REPLICA REPLICAS STEPS [SEED_ADDRESS | @FILE_WITH_IT]

writes ``OUT/addr-<replica>`` (its mesh address), a line a committed step to
``OUT/progress-<replica>.jsonl`` and, at the end, ``OUT/result-<replica>.json``. With
``REPLICA_TEST_STALL_AT=K`` it stops in step K after its backward, before the gradient average,
and says so in ``OUT/stalled-<replica>``: where the test kills it, so that the survivor's average
fails and the step is taken again by the new quorum.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

from distflow.core.node import MeshConfig, Node
from distflow.trainer.replicas import ReplicaSync, StepNotCommitted, find_lighthouse, publish_lighthouse

SAMPLES, LR, SECRET = 8, 0.1, "replica-test-secret-0123"
# The pace of a step: slower alone, so that a killed replica restarted by the test (a new process:
# seconds to import torch on a busy machine) is back before the survivor runs out of steps.
STEP_PAUSE_S, ALONE_PAUSE_S = 0.05, 0.6
STALL_ENV = "REPLICA_TEST_STALL_AT"  # this step: stop after the backward, before the gradient average


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # momentum: state a heal must copy


def step_samples(step: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The ids, inputs and targets of a step's samples (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [f"{step}-{i}" for i in range(SAMPLES)], torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 1,
                                                                                                        generator=g)


def share_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, participants: int) -> torch.Tensor:
    """Squared error summed over a share, over the step's sample count, times the participants:
    averaged over the quorum (torchft's AVG), the gradient is the whole step's mean."""
    return ((model(x) - y) ** 2).sum() / SAMPLES * participants


def reference_weights(steps: int) -> list[float]:
    """One process, every sample of every step once: what the replicas' weights must end as."""
    model, opt = make_model()
    for s in range(steps):
        _, x, y = step_samples(s)
        opt.zero_grad()
        share_loss(model, x, y, 1).backward()
        opt.step()
    return flat(model)


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def train(sync: ReplicaSync, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, out: Path,
          replica: int, stall_at: int | None) -> dict:
    seen: list[int] = []

    def one_step(step: int) -> None:
        ids, x, y = step_samples(step)
        mine = sync.share(ids)
        opt.zero_grad(set_to_none=False)
        if mine:
            share_loss(model, x[mine], y[mine], sync.participants).backward()
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        if step == stall_at:  # the test SIGKILLs this replica here: mid-step, its share not yet averaged
            (out / f"stalled-{replica}").write_text(str(step))
            time.sleep(60)
        sync.average_gradients(model)
        participants = sync.participants
        if not sync.commit():  # a replica dropped out mid-step: take_step takes the whole step again
            raise StepNotCommitted(f"step {step}")
        opt.step()
        seen.append(participants)
        with open(out / f"progress-{replica}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "participants": participants, "ids": [ids[i] for i in mine],
                                "healed": sync.healed, "pid": os.getpid(), "t": round(time.time(), 2)}) + "\n")
        time.sleep(STEP_PAUSE_S if participants > 1 else ALONE_PAUSE_S)

    def step_or_done(step: int) -> bool:  # the quorum's step: a restarted replica heals into the run's
        if step >= steps:
            return True
        one_step(step)
        return False

    while not sync.take_step(step_or_done):
        pass
    return {"participants_seen": seen, "retries": sync.retries, "step": sync.step}


async def main(out: Path, replica: int, replicas: int, steps: int, seed: str | None) -> None:
    if seed and seed.startswith("@"):  # a file the seed writes its address to: started together, not one by one
        path, deadline = Path(seed[1:]), time.monotonic() + 60
        while not path.is_file() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seed = path.read_text()
    node = Node(f"trainer-{replica}", "trainer", secret=SECRET, seeds=[seed] if seed else [],
                config=MeshConfig(protocol_period_s=0.2, suspicion_timeout_s=1.0))
    await node.start()
    (out / f"addr-{replica}").write_text(node.address)
    lighthouse = publish_lighthouse(node, "127.0.0.1") if replica == 0 else None
    address = await find_lighthouse(node, timeout=30)
    model, opt = make_model()

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    sync = await asyncio.to_thread(ReplicaSync, f"replica{replica}", address, state_dict, load_state_dict,
                                   host="127.0.0.1", timeout_s=20)
    # Every replica's manager heartbeating before the first quorum: else the first one trains alone
    # and the others heal into the run at their first step (torchft's lighthouse forms a quorum at once
    # from the replicas it knows of). A restarted replica finds the others ready.
    node.set_meta(ft_ready=True)
    await node.wait_for(lambda ms: sum(bool(m.meta.get("ft_ready")) for m in ms) >= replicas, timeout=30,
                        what="every replica's torchft manager")
    stall = os.environ.get(STALL_ENV)
    result = await asyncio.to_thread(train, sync, model, opt, steps, out, replica, int(stall) if stall else None)
    result.update(weights=flat(model), healed=sync.healed, pid=os.getpid())
    node.set_meta(done=True)
    if lighthouse is not None:  # the others' last quorum needs it: wait (bounded) until they are done or dead
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(
                m.node_id != node.node_id and node.is_alive(m.node_id) and not m.meta.get("done")
                for m in node.members()):
            await asyncio.sleep(0.1)
    sync.close()
    (out / f"result-{replica}.json").write_text(json.dumps(result))
    await asyncio.wait_for(node.stop(), timeout=10)
    if lighthouse is not None:
        lighthouse.shutdown()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                     sys.argv[5] if len(sys.argv) > 5 else None))
