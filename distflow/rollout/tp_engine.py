"""Tensor-parallel generation in the built-in engine: rank 0 (the node's process) drives followers.

Why it exists: a model too large (or too slow) for one GPU is served by a rollout node owning N
GPUs (``rollout_tensor_parallel: N``), as nano-vllm's ModelRunner and vLLM's workers do it. The
node's process is TP rank 0: it holds its own shard (:mod:`distflow.rollout.tp_shard`), runs the
slot batcher and samples; :class:`TensorParallel` spawns N-1 follower processes
(:func:`distflow.rollout.tp_group.follower_main`; on CUDA one GPU each, the node's ``cuda:i+r``)
that load the checkpoint, keep only their shard and then execute every runner call rank 0 makes
(:class:`DrivenRunner` sends it over each follower's pipe first; the decode step's token ids and
positions go over the group as one broadcast, so no host sync is added on CUDA). The ranks meet in
each row-parallel layer's all-reduce, so all hold the same hidden states; rank 0 alone computes the
logits (its LM head is whole) and samples.

Weights: rank 0 receives the full tensors from the trainer as without TP (the weight inbox, the
same validation by name, shape and dtype against the full shapes), keeps its slice, and sends each
follower only its slice of every split parameter (point-to-point over the group) and the
replicated ones (embeddings, norms, a tied LM head) by one broadcast; an untied LM head stays on
rank 0 (:class:`ShardedWeights`).

Failure: a follower dies with the node (its pipe closes; it exits). A dead follower makes the next
call, or the collective under way, raise a RuntimeError naming its rank, pid and exit code (or the
error it reported) at once: a dead peer's connection resets every gloo/NCCL operation with it, and
every command checks that the followers are alive first. A hung (not dead) follower fails every
collective after :data:`COLLECTIVE_TIMEOUT_S`; a follower that does not start within
:data:`START_TIMEOUT_S` is named too. CUDA graphs are off with TP (an eager decode step; capturing
the all-reduces is not done here).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import multiprocessing
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from distflow.rollout.llama_forward import kind_uses_window, unsupported_reason
from distflow.rollout.tp_group import all_reducer, follower_main, make_group, set_local_heads
from distflow.rollout.tp_shard import RANK0_ONLY, REPLICATED, check_divisible, kind_of, shard_model, shard_of
from distflow.rollout.weight_loading import WeightTarget

__all__ = ["COLLECTIVE_TIMEOUT_S", "DrivenRunner", "START_TIMEOUT_S", "ShardedWeights", "TensorParallel"]

START_TIMEOUT_S = 600.0  # a follower's start: importing torch, loading the checkpoint, joining the group
COLLECTIVE_TIMEOUT_S = 300.0  # any one collective (a hung follower; a dead one fails it at once)
_POLL_S = 0.05

log = logging.getLogger(__name__)


class TensorParallel:
    """Rank 0's side of an engine TP group of ``n`` ranks: the followers, their pipes, the group.

    ``model``: rank 0's full model, on the CPU; it is split in place (rank 0's shard) here, so the
    caller moves only the shard to its device. ``runner_kw``: what the followers' runners are built
    with (the engine's memory plan settings). Raises ValueError naming ``rollout_tensor_parallel``
    when the model cannot be split, RuntimeError naming a follower that did not start."""

    def __init__(self, model: Any, model_path: str, n: int, device: torch.device, dtype: torch.dtype, *,
                 runner_kw: dict[str, Any], timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S):
        why = unsupported_reason(model) or ("a sliding window (its long calls run HF's loop)"
                                            if kind_uses_window(model.config) else None)
        if why is not None:
            raise ValueError(f"rollout_tensor_parallel ({n}) needs the engine's static-KV path (Llama/Qwen family); "
                             f"{model_path}: {why}")
        check_divisible(model.config, n)
        self.n, self.device = n, device
        self.full = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in model.state_dict().items()}
        self.check = WeightTarget(model)  # validates against the full shapes (its tensors replaced by meta ones)
        self.check.own = self.full
        devices = [str(device)] * n
        if device.type == "cuda":
            base = device.index or 0
            if base + n > torch.cuda.device_count():
                raise ValueError(f"rollout_tensor_parallel ({n}) needs GPUs {base}..{base + n - 1} of this node, but "
                                 f"{torch.cuda.device_count()} are visible (the launcher gives a rollout node N GPUs)")
            devices = [f"cuda:{base + r}" for r in range(n)]
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; a node's threads must not be
        self.procs: list[Any] = [None]
        self.conns: list[Any] = [None]
        self._drops: list[int] = []
        self.lock = threading.RLock()  # one command (and its local run) at a time, whoever calls
        self._handles = itertools.count()
        self.closed = False
        try:
            for r in range(1, n):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=follower_main, name=f"distflow-engine-tp{r}", daemon=True,
                                args=(r, n, store.port, model_path, devices[r], dtype, timeout_s, runner_kw,
                                      torch.get_num_threads(), theirs))
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
            for r in range(1, n):  # each follower is alive and at the group (or named) before rank 0 waits there
                self._expect(r, "joining", start_timeout_s)
            self.group = make_group(store, 0, n, device, timeout_s)
            self.ready = [self._expect(r, "ready", start_timeout_s) for r in range(1, n)]  # each one's shard bytes
        except BaseException:
            self.close()
            raise
        self.store = store
        self.head = shard_model(model, 0, n, all_reducer(self.group))  # an untied LM head: rank 0's alone
        log.info("engine tensor parallel: %d ranks on %s (followers: %s), %.1f MB of weights per follower",
                 n, ", ".join(devices), ", ".join(f"rank {r} pid {self.procs[r].pid}" for r in range(1, n)),
                 max(self.ready) / 1e6)

    # ------------------------------------------------------------------ the followers
    def follower(self, r: int) -> str:
        p = self.procs[r]
        return f"engine tensor-parallel rank {r} (pid {p.pid})"

    def _expect(self, r: int, kind: str, timeout: float) -> Any:
        """Follower ``r``'s next ``(kind, value)`` message within ``timeout`` s; a dead follower, an
        error it reported or the deadline raise naming it."""
        deadline = time.monotonic() + timeout
        conn = self.conns[r]
        while time.monotonic() < deadline:
            if conn.poll(_POLL_S):
                try:
                    what, value = conn.recv()
                except (EOFError, OSError):
                    raise self._dead(r) from None
                if what == kind:
                    return value
                raise RuntimeError(f"{self.follower(r)} failed: {value}")
            if not self.procs[r].is_alive():
                raise self._dead(r)
        raise RuntimeError(f"{self.follower(r)} sent no {kind!r} within {timeout:g} s")

    def _dead(self, r: int) -> RuntimeError:
        """The error naming follower ``r`` (its exit code, or what it reported before it exited)."""
        p, conn = self.procs[r], self.conns[r]
        said = ""
        try:
            while conn.poll(0):
                what, value = conn.recv()
                if what == "error":
                    said = f": {value}"
        except (EOFError, OSError):
            pass
        p.join(2.0)
        code = "still running" if p.exitcode is None else f"exit code {p.exitcode}"
        return RuntimeError(f"{self.follower(r)} died ({code}){said}; the engine cannot generate without it "
                            "(a node's followers are not restarted: restart the node)")

    def failure(self, e: BaseException) -> RuntimeError:
        """What a failed collective or send means: the follower that died (waited for up to 2 s, as
        a killed peer's connection may reset before its exit is seen), else the error itself."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for r in range(1, self.n):
                if not self.procs[r].is_alive() or self.conns[r].poll(0):
                    err = self._dead(r)
                    err.__cause__ = e
                    return err
            time.sleep(_POLL_S)
        return RuntimeError(f"engine tensor-parallel collective failed (no follower died): {type(e).__name__}: {e}")

    def send(self, op: str, args: tuple = (), reply: bool = False) -> None:
        """Send a command to every follower (after the KV prefixes dropped since the last one)."""
        if self.closed:
            raise RuntimeError("the engine's tensor-parallel group is closed")
        if self._drops:
            drops, self._drops = self._drops, []
            self.send("drop_prefixes", (drops,))
        for r in range(1, self.n):
            if not self.procs[r].is_alive():
                raise self._dead(r)
            try:
                self.conns[r].send((op, args, reply))
            except (BrokenPipeError, EOFError, OSError):
                raise self._dead(r) from None

    def ask(self, op: str, timeout: float = 30.0) -> list[Any]:
        """Every follower's answer to ``op`` (rank order), each within ``timeout`` s."""
        with self.lock:
            self.send(op, (), reply=True)
            return [self._expect(r, "ok", timeout) for r in range(1, self.n)]

    def drop(self, handle: int) -> None:
        self._drops.append(handle)  # from a finalizer: the followers hear it with the next command

    def next_handle(self) -> int:
        return next(self._handles)

    def drive(self, runner: Any) -> "DrivenRunner":
        """Rank 0's runner, made this rank's (its head counts) and wrapped to drive the followers."""
        set_local_heads(runner, self.n)
        return DrivenRunner(runner, self)

    def target(self, model: Any) -> "ShardedWeights":
        """The engine's weight target: full tensors in, shards out (call after the model moved)."""
        return ShardedWeights(self, model)

    def close(self) -> None:
        """Close the pipes (the followers exit), then wait for them a little and kill what is left."""
        self.closed = True
        for c in self.conns[1:]:
            c.close()
        for p in self.procs[1:]:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)


# LlamaRunner methods that only read rank 0's state or act on its graphs (off with TP): called as they are.
# `bind` is the M-RoPE hook, a no-op for a text model (TP refuses vision-language models).
_LOCAL_METHODS = frozenset({"bucket", "length_bucket", "graph_shape", "retry_captures", "free_graphs", "bind"})


class DrivenRunner:
    """Rank 0's :class:`~distflow.rollout.llama_forward.LlamaRunner`, each call made on every rank.

    Reads (``slots``, ``tok_in``, ``device``, ...) and writes go to rank 0's runner; the calls that
    change the cache or run the model are sent to the followers first, then run here; a failure
    during one names the follower (:meth:`TensorParallel.failure`)."""

    def __init__(self, local: Any, tp: TensorParallel):
        object.__setattr__(self, "_local", local)
        object.__setattr__(self, "_tp", tp)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._local, name)
        if inspect.ismethod(value) and name not in _LOCAL_METHODS:
            # a runner method this class does not drive would run on rank 0 alone and leave the others
            # out of its all-reduces (a hang until the timeout): refused by name instead
            raise NotImplementedError(f"LlamaRunner.{name} is not driven over the engine's tensor-parallel group: "
                                      "add it to distflow/rollout/tp_engine.py's DrivenRunner")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._local, name, value)

    def _both(self, op: str, args: tuple, local: Any) -> Any:
        tp = self._tp
        with tp.lock:
            tp.send(op, args)
            try:
                return local()
            except RuntimeError as e:
                raise tp.failure(e) from e

    def reserve(self, slots: int, length: int, grow_to: int | None = None) -> None:
        with self._tp.lock:
            self._local.reserve(slots, length, grow_to)  # rank 0 plans; the followers take its cache shape
            self._tp.send("reserve", (self._local.slots, self._local.length))

    def prefill(self, slots: list[int], seqs: list[list[int]]) -> torch.Tensor:
        return self._both("prefill", (list(slots), [list(s) for s in seqs]), lambda: self._local.prefill(slots, seqs))

    def extend(self, slots: list[int], starts: list[int], seqs: list[list[int]]) -> torch.Tensor:
        return self._both("extend", (list(slots), list(starts), [list(s) for s in seqs]),
                          lambda: self._local.extend(slots, starts, seqs))

    def decode(self, n: int, max_pos: int) -> torch.Tensor:
        r = self._local

        def step() -> torch.Tensor:
            self._tp.group.broadcast(torch.stack([r.tok_in[:n], r.pos[:n]]), 0).wait()  # on the group's device
            return r.decode(n, max_pos)
        return self._both("decode", (n, max_pos), step)

    def move_slot(self, src: int, dst: int, length: int | None = None) -> None:
        self._both("move_slot", (src, dst, length), lambda: self._local.move_slot(src, dst, length))

    def copy_prefix(self, src: int, dsts: list[int], n: int) -> None:
        self._both("copy_prefix", (src, list(dsts), n), lambda: self._local.copy_prefix(src, dsts, n))

    def save_prefix(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank keeps its own heads' copy; rank 0's tensors carry the handle the followers
        know theirs by, and their copies are dropped when rank 0's are collected."""
        tp = self._tp
        h = tp.next_handle()
        k, v = self._both("save_prefix", (h, slot, n), lambda: self._local.save_prefix(slot, n))
        k._tp_handle = h
        weakref.finalize(k, tp.drop, h)
        return k, v

    def load_prefix(self, slot: int, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        self._both("load_prefix", (slot, k._tp_handle, n), lambda: self._local.load_prefix(slot, k, v, n))


class ShardedWeights:
    """The engine's weight target under TP: validated against the full shapes, applied as shards."""

    def __init__(self, tp: TensorParallel, model: Any):
        self.tp = tp
        self.own: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))  # rank 0's shards

    def validate(self, version: int, weights: Any, partial: bool = False) -> list[Mapping[str, torch.Tensor]]:
        return self.tp.check.validate(version, weights, partial)

    @torch.no_grad()
    def copy_in(self, buckets: list[Mapping[str, torch.Tensor]]) -> None:
        """Per bucket: rank 0 copies its slices in, sends each follower its slice of every split
        tensor and broadcasts the replicated ones (:func:`~distflow.rollout.tp_group.receive_weights`
        is the other side, name by name in the same order)."""
        tp = self.tp
        for b in buckets:
            with tp.lock:
                tp.send("weights", (list(b),))
                try:
                    self._send_bucket(b)
                except RuntimeError as e:
                    raise tp.failure(e) from e
        if tp.device.type == "cuda":
            torch.cuda.current_stream(tp.device).synchronize()

    def _send_bucket(self, b: Mapping[str, torch.Tensor]) -> None:
        tp, n = self.tp, self.tp.n
        for tag, name in enumerate(b):
            dst, full = self.own[name], b[name]
            kind = kind_of(name, dst, tp.head)
            dst.copy_(shard_of(name, full, 0, n, tp.head))
            if kind == REPLICATED:
                tp.group.broadcast(dst, 0).wait()  # contiguous: HF's own parameters
            elif kind not in RANK0_ONLY:
                for r in range(1, n):
                    part = shard_of(name, full, r, n, tp.head).to(device=dst.device, dtype=dst.dtype).contiguous()
                    tp.group.send([part], r, tag).wait()
