"""Who gives a CUDA IPC export's counts back when the importer never will: the exporter, for a
message the receiving channel refused before any handler saw it, and for nothing else (see
distflow/weights/tiers.py). Over real channels on a CPU, torch's release of a count
replaced by a recorder (CUDA cannot run here); the GPU test checks that torch then frees the
trainer's block."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from distflow.transport import Endpoint, RemoteError, make_transport
from distflow.transport.movers import cuda_ipc as weight_transport
from distflow.transport.movers.cuda_ipc import send_ipc

SECRET = "test-ipc-release-secret-0123456789abcdef"


def _export(*offsets: int) -> dict:
    """An export as the exporter makes it (one block per offset of its reference counter)."""
    return {"blocks": [{"device": 0, "handle": b"h%d" % o, "size_bytes": 16, "offset_bytes": 0,
                        "ref_handle": b"/torch_ref", "ref_offset": o, "event_handle": None, "event_sync": False,
                        "tensors": [{"name": f"w{o}", "dtype": "float32", "size": [4], "stride": [1], "offset": 0}]}
                       for o in offsets], "empty": []}


def test_an_export_refused_before_any_handler_saw_it_is_released_by_the_exporter(monkeypatch) -> None:
    released: list[tuple[bytes, int]] = []
    monkeypatch.setattr(weight_transport, "_release_counter", lambda h, o: released.append((h, o)))

    async def main() -> None:
        a, b = make_transport("shm", "trainer", SECRET), make_transport("shm", "rollout", SECRET)
        await a.start()
        await b.start()
        peer = Endpoint("rollout", "127.0.0.1", b.port)
        seen: list[dict] = []
        gate = asyncio.Event()
        try:
            # refused unseen (no handler installed yet): nobody opened it, nobody will
            with pytest.raises(RemoteError) as e:
                await send_ipc(a, peer, "weights", {"version": 1}, _export(3, 4), timeout=10)
            assert e.value.code == "no_handler" and released == [(b"/torch_ref", 3), (b"/torch_ref", 4)]
            released.clear()

            # a handler saw it: the counts are the importer's (opened, or released there), whatever it answered
            async def handler(env) -> None:
                seen.append(env.meta)
                if env.meta["version"] == 2:
                    raise ValueError("a delta on a version this node does not hold")
                if env.meta["version"] == 4:
                    await gate.wait()

            b.set_handler(handler)
            with pytest.raises(RemoteError, match="handler_error"):
                await send_ipc(a, peer, "weights", {"version": 2}, _export(6), timeout=10)
            await send_ipc(a, peer, "weights", {"version": 3}, _export(7), timeout=10)
            # no answer in time: the handler may hold the blocks open (here: it does), nothing is released
            with pytest.raises(TimeoutError):
                await send_ipc(a, peer, "weights", {"version": 4}, _export(8), timeout=0.5)
            assert [m["version"] for m in seen] == [2, 3, 4] and seen[0]["ipc"] == _export(6)
            assert released == []
        finally:
            gate.set()
            await a.close()
            await b.close()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_refused_export_no_longer_pins_the_trainers_gpu_memory() -> None:
    """An exported block whose count nobody gives back stays allocated after the trainer frees it
    (torch keeps it in its IPC limbo); one refused before any handler saw it is freed."""
    from distflow.transport.movers.cuda_ipc import export_ipc, release_ipc

    def settled() -> int:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        return torch.cuda.memory_allocated()

    async def main() -> None:
        a, b = make_transport("shm", "trainer", SECRET), make_transport("shm", "rollout", SECRET)  # b: no handler
        await a.start()
        await b.start()
        try:
            base = settled()
            held = torch.ones(1 << 20, device="cuda")
            ipc = export_ipc({"w": held})
            del held
            assert settled() >= base + (4 << 20)  # pinned by its count
            release_ipc(ipc)
            assert settled() == base

            bucket = {"w": torch.ones(1 << 20, device="cuda"), "b": torch.ones(1 << 10, device="cuda")}
            with pytest.raises(RemoteError, match="no_handler"):
                await send_ipc(a, Endpoint("rollout", "127.0.0.1", b.port), "weights", {"version": 1},
                               export_ipc(bucket), timeout=10)
            del bucket
            assert settled() == base
        finally:
            await a.close()
            await b.close()

    asyncio.run(asyncio.wait_for(main(), 60))
