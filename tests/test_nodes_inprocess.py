"""How the nodes that feed the trainers behave when a trainer goes down, on real nodes: real
meshes and shared-memory channels, in this process.

* The rollout's send path (``rollout.worker.send_parts``): a trainer that is down when a rollout
  node sends its step is retried until it is back; when it comes back on other ports
  (``distflow-node --data-port 0``, a container restarted), the retry must go to where the
  mesh says it is now, not to the endpoint it had when the send began.
* A stage worker (here the ``controller: single`` one) whose trainer is down with no live peer
  to show that this node is not the one cut off waits, but only ``step_timeout_s``: then it
  fails naming the trainer, instead of waiting for ever.
"""

from __future__ import annotations

import asyncio

from distflow.core.config import load_config
from tests.conftest import ROOT
from tests.test_packing import make_batch

QUICKSTART = ROOT / "examples" / "grpo_quickstart.yaml"
SECRET = "send-parts-test-secret-0123456789"


def _cfg(*overrides: str):
    return load_config(QUICKSTART, ["rollout_nodes=1", "trainer_nodes=1", "step_timeout_s=60",
                                    "mesh.protocol_period_s=0.1", "mesh.suspicion_timeout_s=0.5", *overrides])


async def _until(cond, what: str, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _trainer(cfg, seeds: list[str], got: list):
    from distflow.buffer.redistribute import parse_part
    from distflow.runtime import Runtime

    rt = Runtime.create(cfg, "trainer", "trainer-0", SECRET, host="127.0.0.1", port=0, data_port=0, seeds=seeds)

    async def handler(env) -> None:
        step, batch = parse_part(env)
        got.append((rt.channel.port, step, env.sender, list(batch.sample_ids)))

    rt.on_data("samples", handler)
    await rt.start()
    return rt


def test_a_trainer_back_on_new_ports_gets_the_pending_step():
    from distflow.rollout.worker import send_parts
    from distflow.runtime import Runtime

    async def main() -> None:
        cfg = _cfg()
        first: list = []
        t1 = await _trainer(cfg, [], first)
        r = Runtime.create(cfg, "rollout", "rollout-0", SECRET, host="127.0.0.1", port=0, data_port=0,
                           seeds=[t1.node.address])
        await r.start()
        t2 = None
        try:
            groups = await r.form_groups()
            batch = make_batch(6, seed=3)
            await asyncio.wait_for(send_parts(r, groups, batch, step=0, shard=0, extra={}), 20)
            assert [(s, who, ids) for _, s, who, ids in first] == [(0, "rollout-0", batch.sample_ids)]
            old_port = t1.channel.port
            await t1.stop(graceful=False)  # the trainer dies ...
            await _until(lambda: not r.node.is_alive("trainer-0"), "the trainer declared dead")
            send = asyncio.create_task(send_parts(r, groups, batch, step=1, shard=0, extra={}), name="send-step1")
            await asyncio.sleep(0.6)  # the send is waiting for the trainer to come back
            assert not send.done()
            second: list = []  # ... and comes back with the same id on other ports
            t2 = await _trainer(cfg, [r.node.address], second)
            assert t2.channel.port != old_port
            await asyncio.wait_for(send, 20)
            assert [(p, s, who, ids) for p, s, who, ids in second] == [(t2.channel.port, 1, "rollout-0",
                                                                         batch.sample_ids)]
        finally:
            for rt in (r, t1, t2):  # stop is idempotent: also after an early failed assert
                if rt is not None:
                    await rt.stop(graceful=False)

    asyncio.run(main())


def test_a_stage_worker_gives_up_on_a_trainer_down_without_a_witness_after_step_timeout():
    from distflow.runtime import PeerLostError, Runtime
    from distflow.stage_worker import run_stage_worker

    async def main() -> None:
        cfg = _cfg("controller=single", "step_timeout_s=3")
        trainer = await _trainer(cfg, [], [])
        seeds = [trainer.node.address]
        rollout, ctl = (Runtime.create(cfg, role, f"{role}-0", SECRET, host="127.0.0.1", port=0, data_port=0,
                                       seeds=seeds) for role in ("rollout", "controller"))
        await rollout.start()
        await ctl.start()
        loop = asyncio.get_running_loop()
        work = asyncio.create_task(run_stage_worker(ctl), name="controller-loop")
        try:
            await _until(lambda: ctl.groups is not None, "the controller's groups")
            # the trainer and the only other peer die: nothing shows this node is not the one cut off
            t0 = loop.time()
            await rollout.stop(graceful=False)
            await trainer.stop(graceful=False)
            await _until(lambda: not ctl.node.is_alive("trainer-0"), "the trainer declared dead")
            await asyncio.sleep(1.0)
            assert not work.done()  # waiting: the trainer may still come back
            try:
                await asyncio.wait_for(work, 10)
            except PeerLostError as e:
                assert "trainer trainer-0 down for 3s (step_timeout_s)" in str(e) and "no live peer" in str(e)
            else:
                raise AssertionError("the controller finished, with its trainer dead")
            assert loop.time() - t0 >= 3.0
        finally:
            work.cancel()
            for rt in (ctl, rollout, trainer):  # stop is idempotent: also after an early failed assert
                await rt.stop(graceful=False)

    asyncio.run(main())
