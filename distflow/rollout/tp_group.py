"""The follower side of the engine's tensor parallelism, and the group both sides use.

Why it exists: with ``rollout_tensor_parallel: N`` the rollout node's process is TP rank 0 and
drives N-1 follower processes (:mod:`distflow.rollout.tp_engine` spawns them), the way
nano-vllm's ModelRunner and vLLM's workers do: rank 0 sends each runner call (reserve, prefill,
extend, decode, slot moves, weights) over a pipe, and every rank then executes the same forward
in lockstep, meeting in the row-parallel layers' all-reduces. A follower computes no logits and
samples nothing (rank 0 does, from the same all-reduced hidden states). The follower process never
reads anything but its pipe and the group: it exits when its pipe closes (rank 0 gone), and a failure of its own is sent
back over the pipe before it exits, so rank 0 can name it.

The group is a standalone c10d process group (gloo on CPU, NCCL on CUDA, one GPU per rank), not
the default one: a rollout node may hold a default group of its own (``--in-process``, the
synchronous loop), and a group's timeout is every collective's deadline.
"""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from distflow.rollout.tp_shard import RANK0_ONLY, REPLICATED, kind_of, shard_model

__all__ = ["follower_main", "make_group", "receive_weights", "set_local_heads"]

STORE_TIMEOUT_S = 120.0  # followers' first connection to rank 0's store (they import torch and load the model first)


def make_group(store: Any, rank: int, n: int, device: torch.device, timeout_s: float) -> Any:
    """A ``n``-rank process group over ``store`` for tensors on ``device``: gloo on CPU, NCCL on
    CUDA; ``timeout_s`` bounds every collective (a hung peer fails it, never a hang)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, n, opts)
    return dist.ProcessGroupGloo(store, rank, n, timeout)


def all_reducer(group: Any):
    """An in-place sum over ``group`` (the row-parallel layers' hook)."""
    def reduce(t: torch.Tensor) -> None:
        group.allreduce([t]).wait()
    return reduce


def set_local_heads(runner: Any, n: int) -> None:
    """The runner's head counts become this rank's (its cache holds ``num_kv_heads / n`` heads)."""
    runner.n_heads //= n
    runner.n_kv //= n


@torch.no_grad()
def receive_weights(group: Any, params: dict[str, torch.Tensor], names: list[str], head: bool) -> int:
    """A follower's side of :meth:`distflow.rollout.tp_engine.ShardedWeights.copy_in` for one
    bucket: each split parameter's shard by a receive from rank 0 straight into the parameter, the
    replicated ones by a broadcast, a row-parallel bias and an untied LM head (``head``) nothing
    (only rank 0 holds them). Returns the bytes received."""
    got = 0
    for tag, name in enumerate(names):
        p = params[name]
        kind = kind_of(name, p, head)
        if kind in RANK0_ONLY:
            continue
        buf = p if p.is_contiguous() else torch.empty_like(p)
        if kind == REPLICATED:
            group.broadcast(buf, 0).wait()
        else:
            group.recv([buf], 0, tag).wait()
        if buf is not p:
            p.copy_(buf)
        got += buf.numel() * buf.element_size()
    return got


def _no_logits(h: torch.Tensor) -> torch.Tensor:
    """A follower's LM head: one column per row instead of the vocabulary (its weights stay, updated
    like every replicated tensor: a tied embedding is the same tensor)."""
    return h[..., :1]


class _Follower:
    """One follower's runner, its saved KV prefixes and its counters."""

    def __init__(self, rank: int, n: int, port: int, model_path: str, device: str, dtype: torch.dtype,
                 timeout_s: float, runner_kw: dict[str, Any], threads: int, conn: Any):
        from distflow.hf import load_causal_lm
        from distflow.rollout.llama_forward import LlamaRunner, module_bytes

        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(threads)  # rank 0's intra-op threads
        store = dist.TCPStore("127.0.0.1", port, n, is_master=False,
                              timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        conn.send(("joining", None))  # rank 0 makes its side of the group only now: it never waits on a dead one
        self.group = make_group(store, rank, n, self.device, timeout_s)
        model = load_causal_lm(model_path, dtype)
        self.head = shard_model(model, rank, n, all_reducer(self.group))  # untied: this rank holds none of it
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.runner = LlamaRunner(self.model, use_graphs=False, **runner_kw)
        set_local_heads(self.runner, n)
        self.runner._planned_slots = lambda slots, length, grow_to: (slots, length)  # rank 0 planned them
        self.runner.lm_head = _no_logits  # only rank 0 samples: a follower's logits would never be read
        self.params = dict(self.model.state_dict(keep_vars=True))
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stats = {"weight_bytes_received": 0, "weight_bytes": module_bytes(self.model), "steps": 0}

    def run(self, op: str, args: tuple) -> Any:
        r = self.runner
        self.stats["steps"] += 1
        if op == "reserve":
            r.reserve(*args)
        elif op == "prefill":
            r.prefill(*args)
        elif op == "extend":
            r.extend(*args)
        elif op == "decode":
            n, max_pos = args
            buf = torch.empty((2, n), dtype=torch.int64, device=self.device)
            self.group.broadcast(buf, 0).wait()
            r.tok_in[:n].copy_(buf[0])
            r.pos[:n].copy_(buf[1])
            r.decode(n, max_pos)
        elif op in ("move_slot", "copy_prefix", "retry_captures", "free_graphs"):
            getattr(r, op)(*args)
        elif op == "save_prefix":
            handle, slot, n = args
            self.saved[handle] = r.save_prefix(slot, n)
        elif op == "load_prefix":
            slot, handle, n = args
            r.load_prefix(slot, *self.saved[handle], n)
        elif op == "drop_prefixes":
            for h in args[0]:
                self.saved.pop(h, None)
        elif op == "weights":
            self.stats["weight_bytes_received"] += receive_weights(self.group, self.params, args[0], self.head)
        elif op == "stats":
            return {**self.stats, "saved_prefixes": len(self.saved)}
        else:
            raise ValueError(f"unknown engine tensor-parallel command {op!r}")
        return None


def follower_main(rank: int, n: int, port: int, model_path: str, device: str, dtype: torch.dtype,
                  timeout_s: float, runner_kw: dict[str, Any], threads: int, conn: Any) -> None:
    """A follower process: join the group (saying so first), build the rank's shard, say ready, then
    run rank 0's commands until its pipe closes. ``("error", text)`` goes back before a failing
    follower exits (rank 0 names it)."""
    try:
        me = _Follower(rank, n, port, model_path, device, dtype, timeout_s, runner_kw, threads, conn)
        conn.send(("ready", me.stats["weight_bytes"]))
        while True:
            try:
                op, args, reply = conn.recv()  # EOF: rank 0 is gone (its end of the pipe closed)
            except (EOFError, OSError):
                os._exit(0)  # nothing to flush; an interpreter shutdown of torch takes seconds
            out = me.run(op, args)
            if reply:
                conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - told to rank 0, then this process ends
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        except Exception:  # noqa: BLE001 - rank 0 gone too
            pass
        os._exit(1)
