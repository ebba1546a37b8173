"""The rollout node's own controller loop: read my prompts, generate, score, route.

There is no driver telling a rollout node what to do. The prompt set is cut into
``rollout_nodes`` shards; rollout rank r owns shard r. For every global step a node:
catches up with the trainers (steps they have already trained are skipped), waits until
its weights are within ``max_staleness`` versions of the step, swaps in newer weights,
runs the rollout group's pipeline (generate -> reward -> advantage) on each shard it
covers, and sends every trainer rank exactly the samples it owns. One message per
trainer per shard per step, empty or not, so trainers know when a step is complete.

Elasticity without a coordinator: a shard whose owner is not alive is adopted by the
next alive rollout rank in ring order, so its prompts are re-issued and no sample is
lost; trainers keep the first part they receive for a (step, shard) and drop repeats.
A node cut off from the trainers waits for them (bounded by ``step_timeout_s``) instead
of exiting; when it is back it skips to the trainers' step and gets current weights. A
trainer that really died is another matter (the trainer group cannot go on without it):
when the mesh has declared a trainer dead for a suspicion timeout while this node still
sees other members alive (so it is not this node that is cut off), or when the other
trainers left, the node stops at once instead of waiting ``step_timeout_s``.

Under a ``distflow run`` that recovers dead trainers (``recover_retries``) the node waits instead,
and when every trainer is back in a new life (its mesh ``boot``) it goes back to the step they
restarted at (their ``start_step``: the checkpoint's), takes the checkpoint's weights (an older
version: :meth:`WeightInbox.follow`) and generates every later step again with the same seeds;
the parts it sends name the trainer lives they were made for, and a trainer drops parts made
for an earlier life of it (:class:`distflow.trainer.worker.SampleInbox`).

With ``eval_dataset`` a node also evaluates held-out prompts when its newest weights reach an
evaluation point, whether it is about to generate or waiting for weights, and after the final
weights (:mod:`distflow.rollout.evaluation`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Collection

from distflow.buffer.dataloader import PromptShard
from distflow.device import call_on, chosen_device, gpu_sharers, node_device
from distflow.buffer.redistribute import ScatterError, scatter
from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.rollout.engine import make_engine
from distflow.rl.eval_report import eval_progress
from distflow.rollout.evaluation import NodeEvaluator
from distflow.rollout.memory_plan import engine_share
from distflow.rollout.stages import RolloutContext
from distflow.step import rollout_half, step_seed
from distflow.runtime import ClusterStopped, Groups, PeerLostError, Runtime, shard_cover
from distflow.trace import Trace
from distflow.weights import WeightInbox
from distflow.rollout.lora_apply import verify_applied

log = logging.getLogger(__name__)
POLL_TIMEOUT_S = 5.0  # how long the engine's mid-generation weight poll waits for the event loop


def engine_memory(cfg: Config, sharers: int) -> dict[str, Any]:
    """The engine's GPU memory keywords (:func:`distflow.rollout.memory_plan.engine_share`): the share
    of the GPU's total memory its processes may use (``engine_gpu_memory_utilization``), a colocated
    trainer rank's part of it (``engine_trainer_memory_fraction``, with ``colocate``), and how many
    engines split the rest (the ``sharers`` nodes placed on the GPU less the trainer), so that a
    trainer that allocates after the engine still finds its budget."""
    util, trainer, engines = engine_share(cfg.engine_gpu_memory_utilization, cfg.engine_trainer_memory_fraction,
                                          sharers, bool(cfg.colocate))
    return {"gpu_memory_utilization": util, "trainer_memory_fraction": trainer, "engines": engines}


def engine_max_length(cfg: Config) -> int | None:
    """Positions the engine's KV cache holds per sequence from the start: the longest prompt a
    step may carry (``max_prompt_length``) plus ``max_new_tokens``; None without a prompt bound."""
    return None if cfg.max_prompt_length is None else cfg.max_prompt_length + cfg.max_new_tokens


def covered_shards(rt: Runtime, groups: Groups) -> list[int]:
    """My shard plus every shard whose owner is down and whose next alive node (ring order) is me."""
    ids, me = [m.node_id for m in groups.rollout], rt.node.node_id
    alive = {i for i in ids if i == me or rt.node.is_alive(i)}
    return [shard for shard in range(len(ids)) if shard_cover(ids, alive.__contains__, shard) == me]


def trainer_step(rt: Runtime, groups: Groups) -> int:
    """Steps the alive trainers have finished (their gossiped policy_version)."""
    versions = []
    for t in groups.trainer:
        m = rt.node.member(t.node_id)
        if m is not None and m.state == "alive":
            versions.append(int(m.meta.get("policy_version", 0)))
    return min(versions) if versions else 0


def trainers_start_step(rt: Runtime, groups: Groups) -> int | None:
    """The step the trainers start at (their checkpoint's with ``resume_from``, else 0), which
    they gossip as ``start_step`` once their model is loaded; None until one has."""
    steps = [m.meta["start_step"] for t in groups.trainer
             if (m := rt.node.member(t.node_id)) is not None and type(m.meta.get("start_step")) is int]
    return max(steps) if steps else None


def trainer_lives(rt: Runtime, groups: Groups) -> dict[str, int]:
    """The life (mesh meta ``boot``) of each trainer alive now: a trainer restarted from a
    checkpoint (``recover_retries``) has a new one."""
    return {t.node_id: m.meta["boot"] for t in groups.trainer
            if rt.node.is_alive(t.node_id) and (m := rt.node.member(t.node_id)) is not None
            and isinstance(m.meta.get("boot"), int)}


class TrainersRestarted(RuntimeError):
    """The trainers this node works for were restarted from a checkpoint: what it generated since
    that checkpoint was made with weights that no longer exist, and is generated again."""


async def send_parts(rt: Runtime, groups: Groups, batch: SampleBatch, *, step: int, shard: int, extra: dict,
                     check: Callable[[], None] | None = None, source_group: str = "rollout",
                     to: Collection[str] | None = None) -> None:
    """Each trainer gets the samples it owns, through the data plane's one routing function
    (``buffer.redistribute.scatter``: one message per trainer, empty or not). A trainer that is
    cut off is retried until it is back, or until the trainers no longer need this step.
    ``check`` raises when the trainers are gone for good; it is also polled WHILE a send waits
    for its ack, so a trainer that dies mid-send is noticed within a second, not after
    ``step_timeout_s``. With ``controller: single`` the whole batch goes to the controller, and
    when the plan puts a worker group next (``worker_groups``) to its rank ``shard % size``
    (:meth:`Runtime.targets_after`); a stage worker forwards through here too (``source_group``).
    With trainer replica groups (``trainer_replicas``) every group gets the whole batch, each rank
    the samples it owns in its group; a trainer not alive is not waited for (the rollout node
    keeps the part and sends it to the trainer's next life: :meth:`RolloutLoop.rejoin_replicas`).
    ``to``: only these targets (a resend)."""
    cfg = rt.cfg
    targets = rt.targets_after(source_group, shard)
    replicas = cfg.trainer_replicas if targets == [m.node_id for m in groups.trainer] else 1
    consumers = [rt.endpoint(t) for t in targets]
    pending = {i for i, t in enumerate(targets) if to is None or t in to}
    deadline = time.monotonic() + cfg.step_timeout_s
    while pending:
        if replicas > 1:  # a dead replica group is not waited for: its next life gets the kept part
            pending -= {i for i in pending if not rt.node.is_alive(targets[i])}
            if not pending:
                return
        live = {i for i in pending if rt.node.is_alive(targets[i])}
        if live:
            for i in live:  # where the mesh says it is now: a consumer back from a restart may have moved
                consumers[i] = rt.endpoint(targets[i])
            send = asyncio.create_task(
                scatter(rt.channel, batch, consumers, step=step, source_rank=shard, timeout=cfg.step_timeout_s,
                        balance=cfg.route_by, num_sources=len(groups.rollout), extra_meta=extra, only=live,
                        replicas=replicas),
                name=f"send-step{step}-shard{shard}")
            lives = {i: _life(rt, targets[i]) for i in live}
            try:
                lost = False
                while not send.done():
                    await asyncio.wait([send], timeout=1.0)
                    if not send.done() and check is not None:
                        check()  # raises (and the finally cancels the send) when the trainers are gone
                    if not send.done() and any(_life(rt, targets[i]) != lives[i] for i in live):
                        # A consumer was declared dead or restarted mid-send (its new life never
                        # acks the old request; e.g. a restarted stage worker): resend once back.
                        lost = True
                        break
                if not lost:
                    pending -= live
                    send.result()
            except ScatterError as e:
                log.warning("step %d shard %d: %s; will retry", step, shard, e)
                pending |= {i for i in live if targets[i] not in e.delivered}
            finally:
                if not send.done():
                    send.cancel()
        if pending:
            if check is not None:
                check()
            if trainer_step(rt, groups) > step:
                return  # the trainers trained this step without us (the shard was adopted)
            if time.monotonic() > deadline:
                raise PeerLostError(f"step {step}: trainers {[targets[i] for i in sorted(pending)]} unreachable "
                                    f"for {cfg.step_timeout_s:.0f}s")
            await asyncio.sleep(0.5)


def _life(rt: Runtime, node_id: str) -> object:
    """Which life of a live member this is (its ``boot`` time: a restarted node has a new one;
    the incarnation also changes with every metadata update); None when it is not alive."""
    m = rt.node.member(node_id)
    return m.meta.get("boot") if m is not None and rt.node.is_alive(node_id) else None


def sent_summary(batch: SampleBatch) -> dict:
    """What the trainers were sent, for the trace: the first sample's prompt tokens (they show
    the chat template), and per sample its reward and whether it was cut at max_new_tokens."""
    t = batch.tensors
    if not len(batch):
        return {"first_prompt_tokens": [], "rewards": [], "truncated": []}
    return {"first_prompt_tokens": t["prompt_tokens"][: int(t["prompt_lens"][0])].tolist(),
            "rewards": [float(r) for r in t["reward"].tolist()] if "reward" in t else [],
            "truncated": [int(x) for x in t["truncated"].tolist()] if "truncated" in t else [],
            "response_lens": [int(x) for x in t["response_lens"].tolist()]}


class RolloutLoop:
    """One rollout node's state: its shard loaders, engine, weight inbox and trace."""

    def __init__(self, rt: Runtime):
        self.rt, self.cfg = rt, rt.cfg
        # Buckets land on the engine's device (pinned-host staging is the sender's job).
        self.inbox = WeightInbox(device=node_device(self.cfg.device) if self.cfg.device == "cuda" else None)
        self._first_batch = False
        self.evaluator: NodeEvaluator | None = None  # with eval_dataset, once the engine is loaded
        rt.on_data("weights", self.inbox.receive)

    def shard_loader(self, s: int) -> PromptShard:
        c = self.cfg
        return PromptShard(c.dataset, s, c.rollout_nodes, seed=c.seed, shuffle=c.shuffle, bad_rows=c.bad_rows,
                           required_keys=(c.prompt_key,))

    async def run(self) -> None:
        rt, cfg = self.rt, self.cfg
        # The engine needs no group: load the model while the other nodes are still joining.
        loading = asyncio.ensure_future(asyncio.to_thread(make_engine, cfg.engine, cfg.model_path,
                                                          device=cfg.device, dtype=cfg.dtype,
                                                          compile=cfg.engine_compile, max_slots=cfg.engine_max_slots,
                                                          max_length=engine_max_length(cfg),
                                                          **({"lora": cfg.lora.model_dump()} if cfg.lora else {}),
                                                          **({"tensor_parallel": cfg.rollout_tensor_parallel}
                                                             if cfg.rollout_tensor_parallel > 1 else {}),
                                                          **engine_memory(cfg, gpu_sharers())))
        try:
            self.groups = groups = await rt.form_groups()
        except BaseException:
            loading.cancel()  # the thread finishes its load; the engine is dropped
            raise
        rank = groups.rank
        self.loaders = {rank: self.shard_loader(rank)}
        self.per_epoch = self.loaders[rank].steps_per_epoch(cfg.prompts_per_step)
        self.total = cfg.total_steps(self.loaders[rank].num_rows)
        self.engine = await loading
        self.weights_update = self.make_weights_update()
        self.pipeline = cfg.plan().pipeline("rollout")
        if cfg.eval_dataset is not None:
            self.evaluator = NodeEvaluator(rt, self.pipeline, self.engine, self.inbox, self.total,
                                           groups.trainer[0].node_id, lambda: covered_shards(rt, groups),
                                           self.load_fresh_weights, rank)
        self.trace = Trace(cfg.output_dir, rt.node.node_id, cfg.trace_samples)
        self.lives = trainer_lives(rt, groups)  # the trainer processes this node generates for
        # trainer_replicas: the parts sent of the steps the quorum has not committed, for a replica group's next life
        self.kept: dict[tuple[int, int], tuple[SampleBatch, dict]] = {}
        log.info("rollout rank %d: shard %d of %d rows, %d steps, pipeline %s", rank, rank,
                 self.loaders[rank].num_rows, self.total, [n.id for n in self.pipeline])
        stopped = False
        try:
            await self.generate_until_done()
        except ClusterStopped as e:
            log.warning("rollout rank %d: %s; stopping", rank, e)
            stopped = True
        await self.load_fresh_weights()
        if not stopped and self.evaluator is not None:
            await self.evaluator.final()
        rt.node.set_meta(policy_version=self.engine.version, state="done")
        self.engine.close()
        log.info("rollout rank %d: done; final weights v%d", rank, self.engine.version)

    async def generate_until_done(self) -> None:
        """Every step of every shard this node covers, until the trainers' final version."""
        rt, cfg, groups, inbox, engine = self.rt, self.cfg, self.groups, self.inbox, self.engine
        rank, total, loaders = groups.rank, self.total, self.loaders
        next_step = {rank: 0}  # per covered shard: the next step to generate
        stalled_since = time.monotonic()
        progress: tuple = ()  # (weights version, trainers' step, evaluations) last seen: any moving is progress
        while inbox.version < total:  # until the trainers have published the final version
            rt.trainers_gone()  # raises when they are gone for good
            await self.rejoin_replicas()
            restarted = self.trainers_restarted()
            if restarted is not None:  # every trainer is back from a checkpoint: generate from its step again
                next_step, stalled_since = dict.fromkeys(next_step, restarted), time.monotonic()
            if self.trainer_lives_changed():  # some are back, not all say their step yet: wait for them
                if time.monotonic() - stalled_since > cfg.step_timeout_s:
                    raise TimeoutError(f"the restarted trainers did not say their start step within "
                                       f"{cfg.step_timeout_s:.0f}s (step_timeout_s)")
                await asyncio.sleep(0.2)
                continue
            # Weights of version v are what v trained steps made: steps below it need no samples (the
            # gossiped step may lag behind them, e.g. right after a resume or on a node that was cut off).
            start = trainers_start_step(rt, groups)
            done = max(trainer_step(rt, groups), inbox.version, start or 0)
            now = (inbox.version, done, eval_progress(rt.node.member, [r.node_id for r in groups.rollout]))
            if now != progress:  # (a node evaluating is progress too)
                progress, stalled_since = now, time.monotonic()
            shards = covered_shards(rt, groups)
            for s in shards:
                if s not in next_step:
                    log.warning("rollout rank %d: adopting shard %d from step %d (its node is down)", rank, s, done)
                    loaders.setdefault(s, self.shard_loader(s))
            next_step = {s: max(next_step.get(s, 0), done) for s in shards}  # catch up; hand back returned shards
            todo = [(k, s) for s, k in next_step.items() if k < total]
            # A resumed run's trainers say their checkpoint's step (0 too) as start_step: until then (or a
            # version past 0) the step to generate is not known.
            resuming = bool(cfg.resume_from) and start is None and done == 0
            if self.evaluator is not None and not resuming and await self.evaluator.if_due(start, done):
                stalled_since = time.monotonic()
            # (version -1: the trainers restarted and their checkpoint's weights are not in yet)
            if not todo or resuming or inbox.version < max(0, min(todo)[0] - cfg.max_staleness):
                # Nothing to do, (staleness bound) weights too old, or a resumed run's step unknown: wait.
                if time.monotonic() - stalled_since > cfg.step_timeout_s:
                    raise TimeoutError(f"no progress for {cfg.step_timeout_s:.0f}s (weights v{inbox.version}, "
                                       f"trainers at step {done}, my shards {next_step})")
                try:
                    await inbox.wait_for(inbox.version + 1, 0.5, rt.trainers_gone)
                except TimeoutError:
                    pass
                continue
            step, shard = min(todo)
            await self.load_fresh_weights()
            if engine.version > step:  # the weights just loaded were trained on that step already (a shard
                next_step[shard] = engine.version  # adopted, a gossiped step behind): no sample of it is needed
                continue
            epoch, in_epoch = divmod(step, self.per_epoch)
            bad_before = loaders[shard].bad_rows_skipped
            rows = loaders[shard].batch(epoch, in_epoch, cfg.rollout_batch)
            t0 = time.perf_counter()
            seed = step_seed(cfg.seed, shard, step)
            stage_stats: dict[str, float] = {}
            refill = (lambda attempt, n, loader=loaders[shard], e=epoch, i=in_epoch:  # noqa: E731
                      loader.reserve(e, i, attempt, n, local_batch=cfg.rollout_batch))
            # The stages run in a pool thread: enter this node's GPU there (a reward model runs in it).
            ctx = RolloutContext(engine, cfg, rows, seed, self.pipeline, stage_stats, self.weights_update, refill)
            batch = await asyncio.to_thread(call_on, chosen_device(), rollout_half, self.pipeline, ctx)
            t_gen = time.perf_counter() - t0
            self.verify_weights()  # the engine may have swapped weights in mid-generation
            if loaders[shard].bad_rows_skipped > bad_before:  # bad_rows: skip (refill rows included)
                stage_stats["bad_rows"] = loaders[shard].bad_rows_skipped - bad_before
            rate = len(batch) / max(t_gen, 1e-9)
            if stage_stats:
                log.info("rollout rank %d step %d shard %d: %s", rank, step, shard, stage_stats)
            if not self._first_batch:
                self._first_batch = True
                self.report_startup()
            extra = {"total_steps": total, "epoch": epoch, "num_rows": loaders[shard].num_rows,
                     "stage_stats": stage_stats, "trainer_lives": self.lives}
            try:
                self.check_trainers()
                await send_parts(rt, groups, batch, step=step, shard=shard, extra=extra, check=self.check_trainers)
            except TrainersRestarted:  # made with weights that are gone: the step is generated again
                log.warning("rollout rank %d: the trainers restarted; step %d shard %d not sent", rank, step, shard)
                continue
            if cfg.trainer_replicas > 1:
                self.kept[(step, shard)] = (batch, extra)
            if self.trace.path is not None:
                self.trace.write(step=step, rank=rank, shard=shard, epoch=epoch,
                                 prompt_ids=[r.prompt_id for r in rows], policy_version=engine.version,
                                 **sent_summary(batch))
            rt.node.set_meta(policy_version=engine.version, samples_per_s=round(rate, 1), step=step,
                             time_generate_s=round(t_gen, 4))
            next_step[shard] = step + 1
            stalled_since = time.monotonic()

    def trainer_lives_changed(self) -> bool:
        """Whether a trainer alive now is in another life than the one this node generates for (a
        replica group restarted alone, which heals from a live one, is not: :meth:`rejoin_replicas`)."""
        return any(self.lives.get(t) != b for t, b in trainer_lives(self.rt, self.groups).items()
                   if t not in self.healing())

    def healing(self) -> list[str]:
        """Trainers in a new life that heal from a live replica group (``trainer_replicas``: the
        launcher restarted their group alone; mesh meta ``heal``)."""
        if self.cfg.trainer_replicas == 1:
            return []
        return [t for t, b in trainer_lives(self.rt, self.groups).items() if self.lives.get(t) != b
                and (m := self.rt.node.member(t)) is not None and m.meta.get("heal") is True]

    async def rejoin_replicas(self) -> None:
        """A replica group restarted alone heals to the quorum's step from a live group and trains
        on from there (no step goes back): send its new life every kept part of the steps the
        quorum has not committed yet (those sent to its previous life, or not sent while it was
        dead), and forget the kept parts of the committed ones."""
        if self.cfg.trainer_replicas == 1:
            return
        committed = max((int(m.meta.get("policy_version", 0)) for t in self.groups.trainer
                         if self.rt.node.is_alive(t.node_id) and (m := self.rt.node.member(t.node_id)) is not None),
                        default=0)
        for key in [k for k in self.kept if k[0] < committed]:
            del self.kept[key]
        back = self.healing()
        if not back:
            return
        now = trainer_lives(self.rt, self.groups)
        self.lives = {**self.lives, **{t: now[t] for t in back}}
        log.warning("rollout rank %d: trainer replica %s rejoined (it heals from a live replica); sending it the "
                    "%d parts of steps %s again", self.groups.rank, ", ".join(back), len(self.kept),
                    sorted({k[0] for k in self.kept}))
        for (step, shard), (batch, extra) in sorted(self.kept.items(), key=lambda kv: kv[0]):
            await send_parts(self.rt, self.groups, batch, step=step, shard=shard, to=set(back),
                             extra={**extra, "trainer_lives": self.lives}, check=self.rt.trainers_gone)

    def check_trainers(self) -> None:
        """For ``send_parts``: raise when the trainers are gone for good (``trainers_gone``) or were
        restarted (:class:`TrainersRestarted`: what is being sent was made for their previous life)."""
        self.rt.trainers_gone()
        if self.trainer_lives_changed():
            raise TrainersRestarted("the trainers were restarted from a checkpoint")

    def trainers_restarted(self) -> int | None:
        """The step to generate from again once EVERY trainer is alive in a new life and says its
        start step (the checkpoint's), else None. The weight inbox forgets the dead lives'
        versions (:meth:`WeightInbox.follow`), so this node waits for the checkpoint's weights."""
        groups, rt = self.groups, self.rt
        lives = trainer_lives(rt, groups)
        if len(lives) < len(groups.trainer) or any(self.lives.get(t) == b for t, b in lives.items()):
            return None
        steps = [m.meta.get("start_step") for t in groups.trainer if (m := rt.node.member(t.node_id)) is not None]
        if not all(type(k) is int for k in steps) or len(set(steps)) != 1:
            return None
        for t, b in lives.items():
            if t in self.inbox.lives:  # the trainer that serves this node: its checkpoint's weights come next
                self.inbox.follow(t, b)
        self.lives = lives
        if self.evaluator is not None:  # its points are fixed again, from the checkpoint's step (evaluated anew)
            self.evaluator.todo = None
        log.warning("rollout rank %d: the trainers restarted from the checkpoint of step %d; generating from step "
                    "%d again with its weights", groups.rank, steps[0], steps[0])
        return steps[0]

    async def load_fresh_weights(self) -> None:
        """Apply the newest complete weights, if any arrived, bucket by bucket in place; the
        time it took and the bytes received for it (streamed buckets too) are gossiped as
        ``time_load_weights_s`` and ``weight_load_bytes`` (the trainers put them in metrics)."""
        update = self.inbox.take_update()
        if update is None:
            return
        t0 = time.perf_counter()
        await asyncio.to_thread(self.engine.load_weights, update.version, update.buckets, update.is_delta)
        self.rt.node.set_meta(time_load_weights_s=round(time.perf_counter() - t0, 4),
                              weight_load_bytes=self.inbox.taken_bytes)
        self.verify_weights()

    def verify_weights(self) -> None:
        """LoRA: check the adapter the engine applied against the checksum the trainer published for
        its version (a WeightSyncError naming the version stops the node), and gossip both."""
        if self.cfg.lora is not None:
            version, checksum = verify_applied(self.engine, self.inbox.checksums)
            self.rt.node.set_meta(weights_version=version, weights_checksum=checksum)

    def make_weights_update(self) -> Callable[[], object] | None:
        """Partial rollout: the engine polls this (from its worker thread) at decode-step
        boundaries and swaps newer weights into the in-flight sequences. The inbox lives on
        the event loop, so the poll hops onto the loop; it never blocks more than a moment.
        With ``max_staleness: 0`` no newer version can exist mid-step: None (synchronous)."""
        if self.cfg.max_staleness == 0 or self.cfg.engine != "torch":
            return None
        import concurrent.futures

        loop, inbox = asyncio.get_running_loop(), self.inbox

        def poll():
            if inbox.pending is None:  # a plain attribute read: cheap, and safe from a thread
                return None
            fut: concurrent.futures.Future = concurrent.futures.Future()

            def take() -> None:  # on the loop; takes the update only if the engine still waits for it
                if not fut.set_running_or_notify_cancel():
                    return  # the engine gave up (below): the update stays pending for the next poll
                try:
                    fut.set_result(inbox.take_update())
                except BaseException as e:  # noqa: BLE001 - never leave the engine thread waiting
                    fut.set_exception(e)

            try:
                loop.call_soon_threadsafe(take)
            except RuntimeError:  # the loop is closed
                return None
            try:
                return fut.result(timeout=POLL_TIMEOUT_S)
            except concurrent.futures.TimeoutError:  # the loop is busy or shutting down
                if fut.cancel():
                    return None  # never ran: nothing was taken
                return fut.result()  # it is running right now: what it took must be applied, not lost

        return poll

    def report_startup(self) -> None:
        """Seconds from the launch (DISTFLOW_T0, set by `distflow run`; else this process's
        start) to this node's first generated batch: logged, and gossiped as ``startup_s``."""
        from distflow.core.launch_env import launch_time, process_start_time

        t0 = launch_time() or process_start_time()
        startup = time.time() - t0
        self.rt.node.set_meta(startup_s=round(startup, 3))
        log.info("rollout rank %d: first batch generated %.2fs after launch (startup_s)", self.groups.rank, startup)


async def run_rollout(rt: Runtime) -> None:
    await RolloutLoop(rt).run()
