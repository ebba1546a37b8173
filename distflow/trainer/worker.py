"""The trainer node's own controller loop: take my samples, update, publish weights.

Each trainer rank receives only the samples it owns (owner = hash(sample_id) mod T),
straight from the rollout nodes. A step is complete when every rollout node's part for it
has arrived (every rollout sends one message per trainer per step, possibly empty). The
ranks then run the trainer group's pipeline (reference logprobs -> update) as one FSDP2
group, publish the new version to their share of the rollout nodes, and rank 0 appends
the step's metrics. Samples older than ``max_staleness`` versions are refused.

Every step's metrics say where its time went: waiting for samples, the pre-update logprob
pass, the update, the weight gather + publish (measured here), generation and weight
loading at the rollout nodes (read from their mesh metadata, ``ROLLOUT_META_KEYS``), and
the update's tokens/s and MFU; and what the step's samples were (lengths, rewards, advantages,
staleness, the engine's logprob mismatch: :mod:`distflow.trainer.step_stats`), the peak memory
and the weight bytes published. Rank 0 also puts the stage times in its own metadata for
``distflow status``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from distflow.trainer.collectives import counted
from distflow.buffer.batch import SampleBatch
from distflow.buffer.redistribute import open_ingress, parse_packed
from distflow.buffer.shard import DuplicatePartError, SourceLostError
from distflow.transport import Envelope
from distflow.transport.movers.posting import Post
from distflow.device import call_on, node_device
from distflow.progress import PUBLISH, STEP_DONE
from distflow.runtime import Groups, Runtime, shard_cover
from distflow.transport.select import weight_tier
from distflow.weights.tiers import serving_plan
from distflow.core.launch_env import healing_replica, run_start, trainer_start
from distflow.launch.checkpoint import PeriodicSaves, check_data_order, data_order
from distflow.step import train_half
from distflow.trainer.actor import Actor, all_reduce
from distflow.trainer.health import DivergenceWatch, EmptyRunWatch
from distflow.trainer.replica_run import (Lead, NothingToHeal, ReplicaLink, ReplicaRows, ReplicaSteps, replica_index,
                                          writes_final_checkpoint)
from distflow.trainer.async_save import CheckpointWriter
from distflow.trainer.stages import build_context, save_checkpoint
from distflow.trainer.step_stats import peak_memory, step_statistics
from distflow.trainer.gather import iter_weight_buckets
from distflow.rl.eval_report import EVAL_KIND, eval_points, eval_progress
from distflow.trainer.evaluation import EvalBook
from distflow.trainer.metrics import MetricsWriter, STAGE_KEYS, plot_reward_curve, plot_timings, with_generated_mean
from distflow.trace import Trace
from distflow.weights import WeightPublisher
from distflow.weights.adapter import AdapterDigest, is_adapter
from distflow.weights.inbox import CHECKSUMS_KEPT

log = logging.getLogger(__name__)

# Keys the rollout nodes put in their mesh metadata (rt.node.set_meta): seconds of their last
# generation batch and of their last weight load, and the bytes received for that load.
ROLLOUT_TIME_KEYS = ("time_generate_s", "time_load_weights_s")
ROLLOUT_META_KEYS = (*ROLLOUT_TIME_KEYS, "weight_load_bytes")
# Beyond step_timeout_s, how long a collective may wait: while rank 0 alone writes the Hugging
# Face checkpoint (4 bytes a parameter: 28 GB for 7B, and as much again for a critic) the other
# ranks wait in the next collective, and the NCCL watchdog would kill the run at the timeout. At
# least this long, more for a model whose checkpoint would take longer at CHECKPOINT_WRITE_BPS
# (checkpoint_write_allowance). A rank that dies is named by the mesh within seconds
# (Runtime.watch_group), whatever this says.
CHECKPOINT_WRITE_ALLOWANCE_S = 1800.0
CHECKPOINT_WRITE_BPS = 50e6  # a slow shared file system's write rate, bytes per second


def checkpoint_write_allowance(model_path: str, critic: bool) -> float:
    """Seconds a collective may wait beyond ``step_timeout_s`` for rank 0's checkpoint write: at
    least :data:`CHECKPOINT_WRITE_ALLOWANCE_S`, else the fp32 bytes written (twice the weight
    files of ``model_path`` when they are bf16, as a rule; twice again with a critic) at
    :data:`CHECKPOINT_WRITE_BPS`. A 70B model: 560 GB, about 3 h."""
    files = [p for p in Path(model_path or ".").glob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    written = 2 * sum(p.stat().st_size for p in files if p.is_file()) * (2 if critic else 1)
    return max(CHECKPOINT_WRITE_ALLOWANCE_S, written / CHECKPOINT_WRITE_BPS)


def collective_timeout_s(cfg: Any) -> float:
    """How long a collective (and a background checkpoint write) may wait: ``collective_timeout_s``,
    else ``step_timeout_s`` plus :func:`checkpoint_write_allowance`, never torch's own default."""
    if cfg.collective_timeout_s is not None:
        return cfg.collective_timeout_s
    critic = any(n.role.value == "CRITIC" for n in cfg.workflow)
    return cfg.step_timeout_s + checkpoint_write_allowance(cfg.model_path, critic)


async def init_process_group(rt: Runtime, groups: Groups) -> None:
    """The trainer group's torch.distributed group (with ``trainer_replicas``: this rank's replica
    group's, a rendezvous of its own). Its rank 0 opens the rendezvous store on any free port
    (``rendezvous_port`` plus the replica index, when pinned) and gossips it; the others read it
    from that rank's metadata. On CUDA the group is bound to this node's GPU (``device_id``), so
    device-less collectives such as ``barrier`` use it from any thread. Collectives may wait
    :func:`collective_timeout_s`."""
    own = groups.own_group("trainer", rt.cfg.trainer_replicas)
    rank = groups.own_rank("trainer", rt.cfg.trainer_replicas)
    head, world, timeout = own[0], len(own), timedelta(seconds=rt.cfg.step_timeout_s)
    port = rt.cfg.rendezvous_port and rt.cfg.rendezvous_port + groups.trainer.index(head) // world
    if rank == 0:
        store = await asyncio.to_thread(lambda: dist.TCPStore(head.host, port, world, is_master=True,
                                                              timeout=timeout, wait_for_workers=False))
        rt.node.set_meta(pg_port=store.port, trainer_start=trainer_start())
    else:
        start = trainer_start()  # (the head's port of this start: not the one its previous life gossiped)

        def head_up(m: Any) -> bool:
            return m.node_id == head.node_id and "pg_port" in m.meta and m.meta.get("trainer_start", 0) == start

        ms = await rt.node.wait_for(lambda ms: any(head_up(m) for m in ms), timeout=rt.cfg.mesh.join_timeout_s,
                                    what=f"{head.node_id}'s rendezvous port (trainer start {start})")
        port = next(m.meta["pg_port"] for m in ms if head_up(m))
        store = await asyncio.to_thread(lambda: dist.TCPStore(head.host, port, world, is_master=False,
                                                                timeout=timeout))
    cuda = rt.cfg.device == "cuda"
    extra = {"device_id": node_device("cuda")} if cuda else {}
    collective = timedelta(seconds=collective_timeout_s(rt.cfg))
    await asyncio.to_thread(dist.init_process_group, "nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world, timeout=collective, **extra)


def rollout_times(member: Callable[[str], Any], rollout_ids: list[str]) -> dict[str, float]:
    """Mean of the rollout nodes' last reported ``time_generate_s`` / ``time_load_weights_s`` /
    ``weight_load_bytes`` (their mesh metadata; ``member`` is ``rt.node.member``); keys absent when
    no node reported one."""
    out: dict[str, float] = {}
    for key in ROLLOUT_META_KEYS:
        vals = [float(m.meta[key]) for i in rollout_ids
                if (m := member(i)) is not None and isinstance(m.meta.get(key), (int, float))]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def throughput(stats: dict[str, float], num_params: int, world: int, peak_flops: float | None) -> dict[str, float]:
    """Trainer tokens/s (prompt + response tokens of the update over its time) and MFU
    (6 x params x tokens / time / (world x peak_flops): forward + backward FLOPs of a dense
    decoder, attention and the recomputations of activation checkpointing not counted). No
    ``mfu`` where the peak is unknown (a CPU, an unlisted GPU without ``peak_flops``): a figure
    against a made-up peak would look like a measurement."""
    t = stats.get("time_update_s", 0.0)
    tokens = stats.get("train_tokens", 0.0)
    out = {"tokens_per_s": tokens / t if t > 0 else 0.0}
    if peak_flops is not None:
        out["mfu"] = 6.0 * num_params * tokens / t / (world * peak_flops) if t > 0 else 0.0
    return out


def trainer_peak_flops(cfg: Any) -> float | None:
    """``peak_flops`` for the mfu metric: the config's, else this GPU's data-sheet figure for
    the compute dtype, else None (no mfu: said once in the log, with how to get one)."""
    from distflow.device import peak_flops, tf32_matmuls

    if cfg.peak_flops is not None:
        return cfg.peak_flops
    name = torch.cuda.get_device_name(node_device("cuda")) if cfg.device == "cuda" and torch.cuda.is_available() \
        else None
    found = peak_flops(name, cfg.dtype)
    if found is not None:
        kind = cfg.dtype if cfg.dtype != "float32" else "float32 (TF32)" if tf32_matmuls() else "float32 (no TF32)"
        log.info("mfu against %s's dense %s peak, %.3g FLOP/s (set peak_flops to override)", name, kind, found)
        return found
    log.info("no mfu: the peak FLOP/s of %s is unknown (set peak_flops to report one)", name or "a CPU")
    return None


class SampleInbox:
    """Stores each received part in the BufferShard under ``(step, "shard-<s>")``. A re-issued
    shard (its node was down) can arrive twice, or after its step was trained: the first part
    wins, repeats are acknowledged and dropped (counted). The rollout stages' counters
    (skipped / resampled / dropped prompts) ride on each shard's part 0 and are summed per step.
    ``num_rows``: the prompt set's row count, as the rollout nodes read it (a resume compares it).
    A part made for another life of this rank (its ``trainer_lives``: the rollout node had not yet
    seen this rank restarted from a checkpoint) is dropped: the rollout node generates it again.
    Parts come as messages (:meth:`receive`) or, from rollout nodes on this host, as posts the
    shard reads when it takes a step (:meth:`accept`; ``buffer.redistribute.open_ingress``)."""

    def __init__(self, rt: Runtime):
        self.rt, self.cfg = rt, rt.cfg
        self.total: int | None = None
        self.num_rows: int | None = None
        self.consumed = 0  # steps already taken out of the buffer
        self.dropped = {"late": 0, "duplicate": 0, "other_life": 0}
        me = rt.node.member(rt.node.node_id)
        self.life = me.meta.get("boot") if me is not None else None  # this process's life (mesh meta "boot")
        self.stage_stats: dict[int, dict[str, float]] = {}
        rt.on_data("samples", self.receive)
        open_ingress(rt.channel, rt.shard, self.accept)

    def _admit(self, env: Envelope | Post) -> tuple[int, str, Any] | None:
        """(step, source, part) of a received part, or None when it is late (counted)."""
        cfg = self.cfg
        step, batch = parse_packed(env)
        shard = env.meta.get("source_rank")
        if not isinstance(shard, int) or not 0 <= shard < cfg.rollout_nodes:
            raise ValueError(f"samples from {env.sender}: source_rank {shard!r} is not a shard of "
                             f"{cfg.rollout_nodes} rollout nodes")
        if self.total is None:
            self.total = int(env.meta["total_steps"])
        if self.num_rows is None and type(env.meta.get("num_rows")) is int:
            self.num_rows = env.meta["num_rows"]
        if step < self.consumed:
            self.dropped["late"] += 1
            return None
        lives = env.meta.get("trainer_lives")
        # A part made for this rank's previous life (before a recovery) is regenerated. A replica group restarted
        # alone goes back no step: a part made for its previous life is as good (it heals into the same steps).
        if isinstance(lives, dict) and not healing_replica() and lives.get(self.rt.node.node_id,
                                                                            self.life) != self.life:
            self.dropped["other_life"] += 1
            return None
        return step, f"shard-{shard}", batch

    async def receive(self, env: Envelope) -> None:
        got = self._admit(env)
        if got is None:
            return
        step, source, batch = got
        try:
            await self.rt.shard.put(batch, step=step, source=source, timeout=self.cfg.step_timeout_s)
        except DuplicatePartError:  # two copies arrived at once
            self.dropped["duplicate"] += 1
            return
        self._count(step, env.meta)

    def accept(self, post: Post) -> None:
        got = self._admit(post)
        if got is None:
            return
        step, source, batch = got
        try:
            self.rt.shard.put_nowait(batch, step=step, source=source)
        except DuplicatePartError:
            self.dropped["duplicate"] += 1
            return
        self._count(step, post.meta)

    def _count(self, step: int, meta: dict[str, Any]) -> None:
        counts = meta.get("stage_stats")
        if meta.get("part") == 0 and isinstance(counts, dict):
            mine = self.stage_stats.setdefault(step, {})
            for k, v in counts.items():
                if isinstance(k, str) and type(v) in (int, float) and math.isfinite(v):
                    mine[k] = mine.get(k, 0) + v


# How long the trainers wait for a rollout node to come back when none is alive (a
# supervising launcher restarts a dead one within seconds) before giving the step up.
ROLLOUT_GRACE_S = 30.0


def rollout_liveness(rt: Runtime, rollout_ids: list[str]) -> Callable[[str], bool]:
    """``alive`` for take_step: true while any rollout node is alive, and for a grace period
    after the last one died (it may be restarting); false at once when they all left."""
    lost_since: list[float | None] = [None]

    def alive(_: str) -> bool:
        if any(rt.node.is_alive(i) for i in rollout_ids):
            lost_since[0] = None
            return True
        if all((m := rt.node.member(i)) is not None and m.state == "left" for i in rollout_ids):
            return False
        now = time.monotonic()
        lost_since[0] = lost_since[0] or now
        return now - lost_since[0] < min(ROLLOUT_GRACE_S, rt.cfg.step_timeout_s)

    return alive


def first_startup(rt: Runtime, rollout_ids: list[str]) -> dict[str, float]:
    """The slowest rollout node's ``startup_s`` (launch to first generated batch), once known."""
    vals = [float(m.meta["startup_s"]) for i in rollout_ids
            if (m := rt.node.member(i)) is not None and isinstance(m.meta.get("startup_s"), (int, float))]
    return {"startup_s": max(vals)} if vals else {}


async def run_trainer(rt: Runtime) -> None:
    cfg = rt.cfg
    inbox = SampleInbox(rt)
    evals = EvalBook(cfg.rollout_nodes) if cfg.eval_dataset else None  # rank 0's; reports reach no other rank
    if evals is not None:
        rt.on_data(EVAL_KIND, evals.receive)
    groups = await rt.form_groups()
    await init_process_group(rt, groups)
    pipeline = cfg.plan().pipeline("trainer")
    # Torch work runs in worker threads, each with its own current CUDA device: every call
    # below enters this node's GPU first (distflow.device.call_on).
    dev = node_device(cfg.device)

    def on_gpu(fn: Any, *args: Any) -> Any:
        return asyncio.to_thread(call_on, dev, fn, *args)

    async def checkpoint(name: str) -> None:
        """A collective gather to host memory; the files are written in the background (rank 0
        the weights and the marker, every rank its optimizer shard: trainer.async_save)."""
        await on_gpu(save_checkpoint, ctx, out_dir / name, None, run_state(), saving)

    actor = await on_gpu(Actor, cfg, any(n.role.value == "REFERENCE" for n in pipeline))
    ctx = await on_gpu(build_context, cfg, pipeline, actor)
    own = groups.own_group("trainer", cfg.trainer_replicas)  # the torch.distributed group (a replica group's)
    rank, world = groups.own_rank("trainer", cfg.trainer_replicas), len(own)
    replica, steps, lead = 0, None, lambda: True
    if cfg.trainer_replicas > 1:  # replica groups kept in step by torchft (trainer.replica_run)
        replica = replica_index(rt, groups)
        link = ReplicaLink(rt, groups, actor, on_gpu)
        await link.start()
        steps = ReplicaSteps(link, lambda share: train_half(pipeline, ctx, share))
        lead = Lead(rt, groups)  # the group that publishes weights and writes the metrics rows
        if replica:
            evals = None  # the held-out evaluation reports go to trainer rank 0 (replica 0's)
    peak = trainer_peak_flops(cfg)
    sources = [f"shard-{s}" for s in range(cfg.rollout_nodes)]
    shard_of = {src: s for s, src in enumerate(sources)}
    rollout_ids = [m.node_id for m in groups.rollout]
    # (replica groups: each group's plan covers every rollout node; the leading group publishes, trainer.replica_run)
    mine = serving_plan([(m.node_id, m.host, m.meta.get("gpu")) for m in own],
                        [(m.node_id, m.host, m.meta.get("gpu")) for m in groups.rollout])[rt.node.node_id]
    publisher = make_publisher(rt, mine)
    publish = publishing(cfg, actor, publisher, keep=bool(mine))
    out_dir = Path(cfg.output_dir)
    saves = PeriodicSaves(cfg, since=run_start())
    # One checkpoint written at a time in the background (trainer.async_save), each within as long as a
    # collective may wait for it.
    saving = await on_gpu(CheckpointWriter, collective_timeout_s(cfg))
    writer = MetricsWriter(out_dir, resume_step=actor.version if cfg.resume_from else None) \
        if rank == 0 and steps is None else None
    if rank == 0 and steps is not None:  # every group's rank 0 keeps its rows; the leading one writes them
        writer = ReplicaRows(out_dir, replica == 0 and not healing_replica(), actor.version if cfg.resume_from
                             else None, lead)
    trackers = None
    if rank == 0 and replica == 0:  # the rows also go to the trackers (distflow/trackers): a ConfigError if one can't start
        from distflow.trackers import open_trackers

        trackers = open_trackers(cfg, rt.node.node_id, actor.version if cfg.resume_from else None)
        writer = trackers.tee(writer)
    if evals is not None and rank == 0:  # (a replica group healing into the run keeps every row: sys.maxsize)
        kept = actor.version if cfg.resume_from else sys.maxsize if healing_replica() else None
        evals.attach(trackers.tee(MetricsWriter(out_dir, resume_step=kept, name="eval.jsonl"), "log_eval"))
    # A trainer restarted from a checkpoint in the same run (recover_retries) keeps the trace of the steps
    # before it only: the later ones are trained again (like metrics.jsonl's rows).
    trace = Trace(cfg.output_dir, rt.node.node_id, cfg.trace_samples,
                  resume_step=actor.version if cfg.resume_from else None)
    log.info("trainer rank %d/%d: pipeline %s, serves weights to %s", rank, world, [n.id for n in pipeline],
             mine)

    step, t_last, t_start = actor.version, time.perf_counter(), time.perf_counter()
    start_step = step
    divergence, emptiness = DivergenceWatch(cfg.max_nonfinite_steps, cfg.lr), EmptyRunWatch()
    inbox.consumed = step  # a resumed run continues at its checkpoint's step
    # The step this run starts at, said explicitly (0 included): a resumed run's rollout nodes wait
    # for it before their first batch, and policy_version 0 cannot tell "at step 0" from "not known yet".
    rt.node.set_meta(policy_version=step, start_step=step)
    rt.set_beat(step)  # this rank's progress, which the others watch (Runtime.watch_group)
    if step or cfg.resume_from:  # (a recovery from a step-0 checkpoint: the rollout nodes forgot v0)
        inbox.dropped["late"] += await rt.shard.discard_before(step)  # parts sent before the nodes knew it
        await publish(step)
    alive = rollout_liveness(rt, rollout_ids)

    # A rollout node evaluating held-out prompts sends no step meanwhile: its progress extends the wait.
    def evaluating(missing: list[str]) -> tuple:  # the evaluation progress of the nodes covering them
        covers = [shard_cover(rollout_ids, rt.node.is_alive, shard_of[m]) for m in missing]
        return eval_progress(rt.node.member, [c for c in covers if c is not None])

    startup: dict[str, float] | None = None
    # A resume's data order (actor.read_run_state checked the config): the rollout nodes' row count
    # is compared with the checkpoint's at the first step, before it is trained.
    saved_order = (actor.resumed or {}).get("data_order") or {}
    unchecked_rows = bool(cfg.resume_from)

    def run_state() -> dict:
        rows = inbox.num_rows if inbox.num_rows is not None else saved_order.get("num_rows")
        return {"step": step, "total_steps": inbox.total, "seed": cfg.seed, "dataset": cfg.dataset,
                "data_order": data_order(cfg, rows)}

    while inbox.total is None or step < inbox.total:
        # The progress counter the other ranks watch (the step's start, each stage of its train half, its
        # end): a rank whose count stays behind another's for hang_timeout_s is named stuck (Runtime.watch_group).
        rt.set_beat(step)
        if steps is not None:  # replica groups: this step's quorum first (a restarted group heals: the quorum's step)
            try:
                step = await steps.begin(step)
            except NothingToHeal as e:  # restarted as the run ended: the other groups are done
                log.warning("trainer rank %d: %s", rank, e)
                break
            if step > inbox.consumed:
                inbox.consumed = step
                inbox.dropped["late"] += await rt.shard.discard_before(step)
            if inbox.total is not None and step >= inbox.total:
                break
        t_wait = time.perf_counter()
        batch: SampleBatch | None = None
        error: Exception | None = None
        try:
            batch = await rt.shard.take_step(step, sources, timeout=cfg.step_timeout_s,
                                             min_version=step - cfg.max_staleness, alive=alive,
                                             progress=evaluating if evals is not None else None)
            if unchecked_rows and batch is not None and inbox.num_rows is not None:
                unchecked_rows = False  # (every rank got a part from each rollout node: they all agree)
                check_data_order(Path(cfg.resume_from), step, saved_order,
                                 {"num_rows": inbox.num_rows, "dataset": cfg.dataset})
        except SourceLostError as e:
            if not all((m := rt.node.member(i)) is not None and m.state == "left" for i in rollout_ids):
                error = e
        except Exception as e:  # noqa: BLE001 - raised below, after the other ranks heard of it
            error = e
        # Every rank stops, fails or trains at the same step (1 = train, 0 = stop, -1 = fail): a stop
        # mid-send can leave one rank its whole step and another none, and a rank training while
        # another checkpoints (or has failed) would pair their collectives wrongly, or wait for ever.
        status = -1.0 if error is not None else float(batch is not None)
        if world > 1:
            status = (await on_gpu(all_reduce, [status], dist.ReduceOp.MIN))[0]
        if status < 0:
            if error is not None:
                raise error
            raise RuntimeError(f"trainer rank {rank}: another trainer rank could not take step {step} "
                               "(its log names the error); stopping with it")
        if status == 0:
            log.warning("trainer rank %d: the rollout nodes left the mesh (the cluster is being stopped); "
                        "saving a checkpoint at step %d", rank, step)
            break
        assert batch is not None
        times = {"time_wait_s": time.perf_counter() - t_wait}
        inbox.consumed = step + 1
        actor.total_steps = inbox.total
        trained = batch
        if steps is None:
            stats = await on_gpu(train_half, pipeline, ctx, batch, rt.stage_beats(step))
        else:  # this group's share of the step, taken again if the quorum does not commit it
            trained, stats = await steps.step(step, batch)
        # the samples trained into the weights (a committed step): like metrics.jsonl, what the final weights saw
        trace.write(step=step, rank=rank, sample_ids=trained.sample_ids,
                    policy_versions=trained.tensors.get("policy_version", torch.zeros(0)).tolist(),
                    **({"participants": steps.sync.participants} if steps is not None else {}))
        t_weights = time.perf_counter()
        rt.set_beat(step, PUBLISH, "publish")  # each rank sends to its own rollout nodes: not compared by collective
        published = await publish(actor.version) if lead() else 0  # (replica groups: the leading one)
        times["time_weights_s"] = time.perf_counter() - t_weights
        if cfg.lora is not None:
            check_reported_adapters(rt.node.member, mine, publish.checksums)
        peaks = {**peak_memory(actor.device), "weight_sync_bytes": float(published)}  # a serving rank's: the max
        summary = await on_gpu(step_statistics, batch, cfg, step, None, peaks)
        n = summary["samples"]
        times.update(rollout_times(rt.node.member, rollout_ids))
        times.update(throughput(stats, actor.num_params, world, peak))
        now = time.perf_counter()
        stages = {k: round(v, 4) for k, v in {**stats, **times}.items() if k in STAGE_KEYS}
        rt.node.set_meta(policy_version=actor.version, step=step, samples_per_s=round(n / (now - t_last), 1), **stages)
        rt.set_beat(step, STEP_DONE, "done")
        rollout_stats = with_generated_mean(inbox.stage_stats.pop(step, {}))  # the counters ride on part 0 (rank 0)
        if writer is not None:
            if startup is None and (startup := first_startup(rt, rollout_ids) or None):
                times.update(startup)
            tokens = (summary.get("prompt_len_mean", 0.0) + summary["response_len_mean"]) * n  # prompt + response
            writer.write({"step": step, "total_steps": inbox.total, "policy_version": actor.version,
                          **summary, "samples": int(n), "samples_per_s": n / (now - t_last),
                          "step_time_s": now - t_last, "throughput": tokens / (now - t_last) / world,
                          "elapsed_s": now - t_start, "dropped_parts": sum(inbox.dropped.values()),
                          **rollout_stats, **stats, **times})
            if trackers is not None:  # (replica groups: replica 0's)
                trackers.samples(step, batch)
        divergence.after_step(step, stats)  # after the row is written: the metrics show the step that stopped it
        emptiness.after_step(step, int(n), rollout_stats)
        t_last = now
        step += 1
        due = saves.due(step, inbox.total)
        if saves.interval and world > 1:  # each rank's clock: the ranks agree (any due: all save at this step)
            due = (await on_gpu(all_reduce, [float(due)], dist.ReduceOp.MAX))[0] > 0
        if due and lead():  # save_every, and every save_interval_s by default: a dead trainer loses little (launch/checkpoint)
            await checkpoint(saves.name(step))
            saving.after(saves.saved(out_dir, step, remove=rank == 0))  # removals once it is complete

    # (replica groups: the leading one's final checkpoint, or another's when it died first)
    if steps is None or await writes_final_checkpoint(lead, out_dir / "checkpoint", step, cfg.step_timeout_s):
        await checkpoint("checkpoint")
        saving.after(saves.superseded(remove=rank == 0))
    await on_gpu(saving.close)  # the final checkpoint complete before the process group goes
    if writer is not None:
        if evals is None:  # else once the final evaluation is in (below)
            await asyncio.to_thread(plot_reward_curve, writer.path, out_dir / "reward_curve.png")
        await asyncio.to_thread(plot_timings, writer.path, out_dir / "timings.png")
    await publisher.flush(timeout=30)
    await publisher.close()
    rt.node.set_meta(state="done")
    if steps is not None:  # (a lighthouse hosted here: the other groups' last quorums need it)
        await steps.link.close(cfg.step_timeout_s)
    await on_gpu(counted, "barrier", dist.barrier)
    dist.destroy_process_group()
    if evals is not None and writer is not None:  # rank 0: the rollout nodes evaluate the final weights now
        if inbox.total is not None and step == inbox.total:
            def evaluating_nodes() -> bool:  # (a node that is done has sent its last report)
                return any(rt.node.is_alive(i) and (m := rt.node.member(i)) is not None
                           and m.meta.get("state") != "done"
                           for i in rollout_ids)

            if not await evals.wait_for(step, cfg.step_timeout_s, evaluating_nodes,
                                        lambda: eval_progress(rt.node.member, rollout_ids)):
                log.warning("trainer rank 0: the evaluation of the final weights (step %d) did not complete", step)
            evals.finish(eval_points(cfg, start_step, step))
        else:
            evals.finish()
        await asyncio.to_thread(plot_reward_curve, writer.path, out_dir / "reward_curve.png", evals.writer.path)
    if trackers is not None:
        await asyncio.to_thread(trackers.close)
    st = rt.shard.stats()
    log.info("trainer rank %d: done after %d steps (dropped parts: %s; parts taken in %d, of them posted by "
             "same-host nodes %d, posts refused %d)", rank, step, inbox.dropped, st["puts"], st["posted_parts"],
             st["posts_refused"])


def make_publisher(rt: Runtime, peers: list[str]) -> WeightPublisher:
    """This rank's publisher to the rollout nodes it serves, each by the tier its locality
    allows (CUDA IPC on one host between GPUs, NCCL across hosts, the data channel otherwise)."""
    cfg = rt.cfg

    def transport_of(peer: str) -> str:
        m, ep = rt.node.member(peer), rt.endpoint(peer)
        same_host = rt.channel.is_local(ep)
        peer_cuda = (m.meta.get("device") if m else "cpu") == "cuda"
        mine = rt.node.member(rt.node.node_id)
        gpus = (mine.meta.get("gpu") if mine else None, m.meta.get("gpu") if m else None)
        return weight_tier(cfg.weight_transport, same_host, cfg.device == "cuda", peer_cuda,
                           nccl_channel=rt.channel.supports("nccl"),
                                 same_gpu=gpus[0] is not None and gpus[0] == gpus[1])

    publisher = WeightPublisher(rt.channel, peers, rt.endpoint, rt.node.is_alive,
                                timeout=min(cfg.step_timeout_s, 60.0), sync=cfg.weight_sync,
                                transport_of=transport_of, bucket_bytes=cfg.weight_bucket_mb << 20,
                                life=(me.meta.get("boot") if (me := rt.node.member(rt.node.node_id)) else None))

    for p in peers:  # the lives they have now: a new one later is a restart
        if (m := rt.node.member(p)) is not None:
            publisher.member_event("known", p, m.meta.get("boot"))
    rt.node.subscribe(lambda event, m: publisher.member_event(event, m.node_id, m.meta.get("boot")))
    return publisher


def publishing(cfg: Any, actor: Actor, publisher: WeightPublisher, keep: bool):
    """``await publish(version)``: gather the weights bucket by bucket (a collective: EVERY
    rank calls it) and stream them to this rank's peers; ranks serving no peer (``keep``
    False) only send their shards to the serving ranks (see ``iter_weight_buckets``). With LoRA
    only the adapters travel, and every commit carries their checksum (``publish.checksums``:
    version -> checksum, this rank's newest, what its peers must report applying)."""
    bucket = cfg.weight_bucket_mb << 20
    # The engines run in the compute dtype: publish in it (half the bytes of the fp32 masters). LoRA
    # publishes the adapters only, in fp32 (a few MB): the engine merges them into its base in fp32.
    lora = cfg.lora is not None
    dtype = actor.compute_dtype if actor.compute_dtype != torch.float32 and not lora else None

    async def publish(version: int) -> int:  # the bytes this rank holds of the version (0: it serves no peer)
        alloc = publisher.gather_alloc() if actor.device.type == "cpu" and keep else None
        it = iter_weight_buckets(actor.model, bucket, keep=keep, device=actor.device, alloc=alloc, dtype=dtype,
                                 only=is_adapter if lora else None)
        if not lora:
            return await publisher.publish_iter(version, it)
        digest = AdapterDigest()  # the checksum every commit carries; the rollout node checks what it applied
        nbytes = await publisher.publish_iter(version, digested(it, digest),
                                              lambda: {"checksum": digest.hexdigest()})
        if keep:
            published[version] = digest.hexdigest()
            for old in sorted(published)[:-CHECKSUMS_KEPT]:
                del published[old]
        return nbytes

    published: dict[int, str] = {}  # version -> adapter checksum, what this rank's peers must report
    publish.checksums = published  # type: ignore[attr-defined]
    return publish


def digested(it: Any, digest: AdapterDigest) -> Any:
    """``it``'s buckets, each fed to ``digest`` on the way (in the gather's thread)."""
    for b in it:
        digest.update(b)
        yield b


def check_reported_adapters(member: Callable[[str], Any], peers: list[str], published: dict[int, str]) -> None:
    """LoRA: each rollout node this rank serves gossips the version its engine holds and the checksum
    of the adapter it applied (``weights_version`` / ``weights_checksum``); one that differs from
    what this rank published for that version is an error naming the node and the version: the
    node would otherwise sample from another policy than the one trained (its base, as a rule).
    ``member``: ``rt.node.member``."""
    for p in peers:
        m = member(p)
        v = m.meta.get("weights_version") if m is not None else None
        if not isinstance(v, int) or v not in published:
            continue
        if m.meta.get("weights_checksum") != published[v]:
            raise RuntimeError(f"weights v{v}: rollout node {p} applied an adapter with checksum "
                               f"{m.meta.get('weights_checksum')!r}, but this trainer published {published[v]!r} "
                               "for that version (model.lora): its rollouts would not come from the trained policy")
