"""CPU checks of rollout/data-plane logic that matters on the first GPU run: the engine's
mid-generation weight poll never loses an update, and a SampleBatch keeps its fields in host
memory whatever device a stage computed them on."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from unittest import mock

import torch

from distflow.buffer.batch import SampleBatch
from distflow.weights import WeightInbox, WeightUpdate
from distflow.rollout import worker
from distflow.rollout.worker import RolloutLoop


def _loop_with_inbox() -> RolloutLoop:
    loop = RolloutLoop.__new__(RolloutLoop)  # no Runtime: only what make_weights_update reads
    loop.cfg = SimpleNamespace(max_staleness=1, engine="torch")
    loop.inbox = WeightInbox()
    return loop


def test_poll_timeout_keeps_the_update(monkeypatch) -> None:
    """The engine thread gives up waiting while the event loop is busy: the update it asked for
    must stay pending (it used to be taken afterwards and dropped, so the engine never loaded a
    version the staleness gate believed it had)."""
    monkeypatch.setattr(worker, "POLL_TIMEOUT_S", 0.05)
    update = WeightUpdate(3, [{"w": torch.ones(2)}], False)

    async def main() -> None:
        rl = _loop_with_inbox()
        poll = rl.make_weights_update()
        assert poll is not None
        rl.inbox.pending = update
        got: list = []
        t = threading.Thread(target=lambda: got.append(poll()))
        t.start()
        time.sleep(0.3)  # the loop is blocked: the poll's callback cannot run in time
        t.join()
        assert got == [None]
        await asyncio.sleep(0.01)  # the late callback runs now
        assert rl.inbox.pending is update  # not taken by the abandoned poll
        assert await asyncio.to_thread(poll) is update  # the next poll delivers it
        assert rl.inbox.pending is None
        assert await asyncio.to_thread(poll) is None

    asyncio.run(main())


def test_poll_off_when_synchronous() -> None:
    async def main() -> None:
        rl = _loop_with_inbox()
        rl.cfg.max_staleness = 0
        assert rl.make_weights_update() is None

    asyncio.run(main())


def test_batch_fields_land_in_host_memory() -> None:
    """set_scalar / set_ragged move a stage's (e.g. CUDA) result to the CPU: routing, select()
    and the wire forms use numpy views, which a CUDA tensor cannot give."""
    b = SampleBatch.from_lists(["a", "b"], ["p", "p"], [[1, 2], [3]], [[4], [5, 6]], [[-0.1], [-0.2, -0.3]])
    scalar, flat = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25, 0.125])
    fake_scalar = mock.Mock(shape=torch.Size([2]))
    fake_scalar.cpu.return_value = scalar
    fake_flat = mock.Mock(shape=torch.Size([3]))
    fake_flat.cpu.return_value = flat
    b.set_scalar("reward", fake_scalar)
    b.set_ragged("ref_logprobs", fake_flat)
    fake_scalar.cpu.assert_called_once()
    fake_flat.cpu.assert_called_once()
    assert b.tensors["reward"] is scalar and b.tensors["ref_logprobs"] is flat
    sel = b.select([1])
    assert sel.tensors["reward"].tolist() == [2.0] and sel.tensors["ref_logprobs"].tolist() == [0.25, 0.125]
    cpu = torch.tensor([3.0, 4.0])
    b.set_scalar("advantage", cpu)
    assert b.tensors["advantage"] is cpu  # a CPU tensor is kept as is (no copy)
