"""Distributed prompt loader: each rollout rank reads only its own shard of the prompt set.

There is no driver to hand out prompts, so every rank must compute the same epoch order
on its own and take a disjoint slice of it. For epoch ``e`` the order is a permutation of
``range(num_rows)`` seeded by ``(seed, e)`` (identity without shuffle); rank ``r`` of
``W`` owns ``perm[r::W]`` and step ``j`` is ``[j*B:(j+1)*B]`` of that. Every rank therefore
agrees on ``num_rows`` and ``steps_per_epoch``, the shards are disjoint and cover the
epoch, and the position ``(epoch, step)`` is all a resumed run needs.

JSONL: a scan of newline offsets (no parsing) gives ``num_rows``; only this rank's rows
are ever parsed. Blank lines are not rows. Parquet: the footer gives the row count and
row-group sizes; a batch reads only the row groups holding its rows. A bad row raises
:class:`DatasetError` naming the file, the line (or Parquet row) and the problem, or is
skipped and counted with ``bad_rows="skip"``: :class:`BadRowPolicy`, the one implementation
of that rule. A row may also be bad for a reason the loader is not told of (it lacks a key
the workflow's reward function reads): every row keeps its location and its loader's policy,
so the stage that finds out (:func:`keep_row`) raises or skips and counts it the same way,
in the same ``bad_rows_skipped``.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

# Types accepted for well-known keys; other required keys only need to be present and not null.
DEFAULT_KEY_TYPES: dict[str, tuple[type, ...]] = {"prompt": (str, list)}


class DatasetError(ValueError):
    """A prompt file or row that cannot be used; the message names file, line/row and problem."""


class BadRowPolicy:
    """What happens to a row that cannot be used (``bad_rows``): ``error`` raises its
    :class:`DatasetError`, ``skip`` logs it (the first five, then every 1000th) and counts it."""

    def __init__(self, mode: str = "error"):
        if mode not in ("error", "skip"):
            raise ValueError(f"bad_rows must be 'error' or 'skip', got {mode!r}")
        self.mode = mode
        self.skipped = 0
        self._lock = threading.Lock()  # a dynamic-sampling refill reads rows in a worker thread

    def reject(self, problem: DatasetError) -> None:
        if self.mode == "error":
            raise problem
        with self._lock:
            self.skipped += 1
            n = self.skipped
        if n <= 5 or n % 1000 == 0:
            log.warning("skipping bad row #%d (bad_rows: skip): %s", n, problem)


@dataclass
class PromptRow:
    prompt_id: str  # f"e{epoch}:{row_index}"
    row_index: int
    data: dict[str, Any]
    where: str = ""  # "file:line" (or "file: row N"), for messages about the row; "" for rows made elsewhere
    policy: BadRowPolicy | None = field(default=None, repr=False, compare=False)  # the loader's, when it read it
    source: str = ""  # the file it was read from ("" for rows made elsewhere): a row's image paths are relative to it


def _absent(data: Mapping[str, Any], key: str) -> bool:
    return key not in data or data[key] is None


def keep_row(row: PromptRow, keys: Mapping[str, str], fallback: BadRowPolicy,
             checks: Sequence[tuple[Callable[[dict], str | None], str]] = ()) -> bool:
    """True when the row has every key of ``keys`` (key -> what reads it, e.g. "reward 'gsm8k'")
    and no ``checks`` entry (check(row) -> problem or None, who checks) finds a problem. Else the
    row is rejected, as a missing required key is when the loader reads it, through the policy
    of the loader that read it (``fallback`` for a row made elsewhere): raised, or skipped and
    counted, and False. A check that raises, or returns neither None nor a str, is a bug in the
    check: raised whatever the policy (under ``skip`` it would drop every row quietly)."""
    mapping = isinstance(row.data, Mapping)
    data = row.data if mapping else {}
    where = row.where or "prompt " + row.prompt_id
    missing = next((k for k in keys if _absent(data, k)), None)
    if missing is not None:
        has = sorted(data) if mapping else type(row.data).__name__
        problem = f"key {missing!r} is null" if missing in data else f"missing key {missing!r}"
        (row.policy or fallback).reject(DatasetError(
            f"{where}: {problem}, which {keys[missing]} reads (prompt {row.prompt_id}; the row has {has})"))
        return False
    for check, who in checks:
        if not mapping:
            problem = f"the row is a {type(row.data).__name__}"
        else:
            try:
                problem = check(data)
            except Exception as e:  # a bug in the check, not a bad row: skipping would drop every row quietly
                raise RuntimeError(f"the check_row of {who} raised on {where} (prompt {row.prompt_id}): "
                                   f"{type(e).__name__}: {e}") from e
            if problem is not None and not isinstance(problem, str):
                raise TypeError(f"the check_row of {who} must return None (the row is fine) or a str (what is "
                                f"wrong with it), got {problem!r} on {where}")
        if problem:
            (row.policy or fallback).reject(DatasetError(
                f"{where}: {problem}, so {who} cannot score it (prompt {row.prompt_id})"))
            return False
    return True


class _JsonlSource:
    """Row index of a JSONL file: byte offset, length and 1-based line number of each non-blank line."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        if size == 0:
            self.starts = self.lengths = self.lines = np.zeros(0, dtype=np.int64)
            return
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            data = np.frombuffer(mm, dtype=np.uint8)
            chunk = 64 << 20  # bounded temporary memory for big files
            newlines = np.concatenate([np.flatnonzero(data[i:i + chunk] == 10) + i
                                       for i in range(0, size, chunk)]).astype(np.int64)
            ends = newlines if (newlines.size and newlines[-1] == size - 1) else np.append(newlines, size)
            starts = np.concatenate(([0], newlines + 1))[: ends.size]
            lengths = ends - starts
            # strip a trailing '\r' (CRLF files) before deciding what is blank
            nonempty = lengths > 0
            cr = np.zeros_like(nonempty)
            cr[nonempty] = data[ends[nonempty] - 1] == 13
            lengths = lengths - cr
            keep = lengths > 0
            # a line of only spaces or tabs is blank too: checked where a line starts with one (rare)
            for i in np.flatnonzero(keep & np.isin(data[np.minimum(starts, size - 1)], (9, 32))):
                keep[i] = bool(mm[starts[i]:starts[i] + lengths[i]].strip())
            del data
        self.starts = starts[keep]
        self.lengths = lengths[keep]
        self.lines = (np.flatnonzero(keep) + 1).astype(np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.starts.size)

    def read(self, rows: Sequence[int]) -> list[tuple[int, str, Any]]:
        """[(row, location, parsed value or a DatasetError)] for the given row indices."""
        out: list[tuple[int, str, Any]] = []
        with open(self.path, "rb") as f:
            for r in rows:
                where = f"{self.path}:{int(self.lines[r])}"
                f.seek(int(self.starts[r]))
                raw = f.read(int(self.lengths[r]))
                try:
                    value = json.loads(raw)
                except (ValueError, RecursionError) as e:  # also: over-long ints, nesting past the parser's depth
                    value = DatasetError(f"{where}: invalid JSON ({type(e).__name__}: {str(e)[:200]})")
                out.append((r, where, value))
        return out


class _ParquetSource:
    """Row index of a Parquet file from its footer; reads only the needed row groups (small LRU)."""

    def __init__(self, path: str, cache_groups: int = 2):
        import pyarrow.parquet as pq  # noqa: PLC0415 - only needed for Parquet input

        self.path = path
        try:
            self._file = pq.ParquetFile(path)
        except Exception as e:
            raise DatasetError(f"{path}: cannot open as Parquet ({e})") from None
        md = self._file.metadata
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        self._bounds = np.cumsum([0, *sizes]).tolist()
        self._cache: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        self._cache_groups = cache_groups

    @property
    def num_rows(self) -> int:
        return int(self._bounds[-1])

    def _group(self, g: int) -> list[dict[str, Any]]:
        rows = self._cache.get(g)
        if rows is None:
            rows = self._file.read_row_group(g).to_pylist()
            self._cache[g] = rows
            while len(self._cache) > self._cache_groups:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(g)
        return rows

    def read(self, rows: Sequence[int]) -> list[tuple[int, str, Any]]:
        out: dict[int, tuple[int, str, Any]] = {}
        by_group: dict[int, list[int]] = {}
        for r in rows:
            by_group.setdefault(bisect.bisect_right(self._bounds, r) - 1, []).append(r)
        for g in sorted(by_group):
            try:
                data = self._group(g)
            except Exception as e:  # a corrupt row group: each of its rows is a bad row (bad_rows decides)
                lo, hi = self._bounds[g] + 1, self._bounds[g + 1]
                bad = DatasetError(f"{self.path}: row group {g} (rows {lo}-{hi}) cannot be read "
                                   f"({type(e).__name__}: {str(e).strip()[:200]})")
                for r in by_group[g]:
                    out[r] = (r, f"{self.path}: row {r + 1}", bad)
                continue
            for r in by_group[g]:
                out[r] = (r, f"{self.path}: row {r + 1}", data[r - self._bounds[g]])
        return [out[r] for r in rows]


class PromptShard:
    """This rank's shard of a JSONL/Parquet prompt set, deterministic per (seed, epoch), resumable."""

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        bad_rows: str = "error",
        required_keys: Sequence[str] = ("prompt",),
        key_types: Mapping[str, tuple[type, ...]] | None = None,
    ):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self._policy = BadRowPolicy(bad_rows)  # refuses an unknown mode
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: prompt file not found")
        self.path = path
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.bad_rows = bad_rows
        self.required_keys = tuple(required_keys)
        self.key_types = dict(DEFAULT_KEY_TYPES if key_types is None else key_types)
        lower = path.lower()
        if lower.endswith((".jsonl", ".ndjson")):
            self._src: _JsonlSource | _ParquetSource = _JsonlSource(path)
        elif lower.endswith((".parquet", ".pq")):
            self._src = _ParquetSource(path)
        else:
            raise DatasetError(f"{path}: unknown prompt file format (expected .jsonl, .ndjson, .parquet or .pq)")
        if isinstance(self._src, _ParquetSource):  # a column missing from the file: not a row's problem
            columns = self._src._file.schema_arrow.names
            for key in self.required_keys:
                if key not in columns:
                    raise DatasetError(f"{path}: no column {key!r}; its columns: {', '.join(columns)} (prompt_key "
                                       f"names the column holding the prompts, e.g. prompt_key: {columns[0]})"
                                       if columns else f"{path}: no column {key!r}; the file has no columns")
        self.num_rows: int = self._src.num_rows
        if self.num_rows == 0:  # else every node would finish at once and the trainers wait for step 0
            raise DatasetError(f"{path}: the prompt file has no rows")
        self._epoch = 0
        self._step = 0
        self._rows_cache: tuple[int, np.ndarray] | None = None

    @property
    def bad_rows_skipped(self) -> int:
        """Rows skipped (``bad_rows: skip``): by this loader, and by stages that checked its rows later."""
        return self._policy.skipped

    # ------------------------------------------------------------------ order
    def steps_per_epoch(self, global_batch: int) -> int:
        """ceil(num_rows / global_batch): identical on every rank."""
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
        return math.ceil(self.num_rows / global_batch)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of all row indices (int64 [num_rows])."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(epoch)])))
        return rng.permutation(self.num_rows).astype(np.int64)

    def rank_rows(self, epoch: int) -> np.ndarray:
        """This rank's row indices for ``epoch`` in order: perm[rank::world_size]."""
        cache = self._rows_cache  # read once: a dynamic-sampling refill reads from a worker thread
        if cache is None or cache[0] != epoch:
            cache = self._rows_cache = (epoch, self.permutation(epoch)[self.rank:: self.world_size].copy())
        return cache[1]

    # ------------------------------------------------------------------ reading
    def batch(self, epoch: int, step: int, local_batch: int) -> list[PromptRow]:
        """This rank's rows of step ``step`` of ``epoch`` (short or empty at the end of the epoch)."""
        if not isinstance(local_batch, int) or local_batch < 1:
            raise ValueError(f"local_batch must be a positive int, got {local_batch!r}")
        if epoch < 0 or step < 0:
            raise ValueError(f"epoch and step must be >= 0, got {epoch}, {step}")
        rows = self.rank_rows(epoch)[step * local_batch:(step + 1) * local_batch].tolist()
        return self._read(rows, lambda r: f"e{epoch}:{r}")

    def reserve(self, epoch: int, step: int, attempt: int, n: int, *, local_batch: int) -> list[PromptRow]:
        """``n`` extra rows of this rank's shard for step ``step`` (DAPO's dynamic sampling
        replaces the prompts it filtered out with these), ``local_batch`` being the step's own
        batch size. Never one of the step's own rows (a kept prompt would be trained twice in
        one step), never a row an earlier attempt of the step drew: attempt ``a`` takes rows
        ``[a * local_batch, a * local_batch + n)`` of one permutation per (seed, epoch, step) of
        the shard's other rows (``n <= local_batch``: it replaces some of the step's prompts), so
        the draw is deterministic and a resumed run draws the same. Fewer when the shard runs
        out. Their prompt ids (``e<epoch>:<row>:r<step>.<attempt>``) never collide with the step's own."""
        if epoch < 0 or step < 0 or attempt < 0 or n < 0 or local_batch < 1:
            raise ValueError(f"epoch, step, attempt, n must be >= 0 and local_batch >= 1, got {epoch}, {step}, "
                             f"{attempt}, {n}, {local_batch}")
        n = min(n, local_batch)
        shard = self.rank_rows(epoch)
        own = set(shard[step * local_batch:(step + 1) * local_batch].tolist())
        pool = np.array([r for r in shard.tolist() if r not in own], dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, step, 0xDA90])))
        order = rng.permutation(pool) if len(pool) else pool
        rows = order[attempt * local_batch:attempt * local_batch + n].tolist()
        return self._read(rows, lambda r: f"e{epoch}:{r}:r{step}.{attempt}")

    def _read(self, rows: list[int], prompt_id: Callable[[int], str]) -> list[PromptRow]:
        out: list[PromptRow] = []
        for r, where, value in self._src.read(rows):
            problem = value if isinstance(value, DatasetError) else self._row_problem(value, where)
            if problem is not None:
                self._policy.reject(problem)  # raises with bad_rows: error
                continue
            out.append(PromptRow(prompt_id(r), r, value, where, self._policy, self.path))
        return out

    def problems(self, rows: Sequence[int], keys: Mapping[str, str] | None = None,
                 checks: Sequence[tuple[Callable[[dict], str | None], str]] = (),
                 chunk: int = 1024) -> Iterator[DatasetError]:
        """The problem of each bad row among ``rows`` (row indices), in their order: what reading
        it in a step would raise (``bad_rows: error``) or skip, with :func:`keep_row`'s ``keys`` and
        ``checks`` (the workflow's rewards') applied as the rollout stages apply them. Counts nothing,
        whatever ``bad_rows`` is: a check before a run (``distflow run``, ``distflow-node --check``)."""
        strict = BadRowPolicy("error")
        for i in range(0, len(rows), chunk):
            for r, where, value in self._src.read(rows[i:i + chunk]):
                problem = value if isinstance(value, DatasetError) else self._row_problem(value, where)
                if problem is None:
                    try:
                        keep_row(PromptRow(f"e0:{r}", r, value, where, strict), keys or {}, strict, checks)
                    except DatasetError as e:
                        problem = e
                if problem is not None:
                    yield problem

    def _row_problem(self, value: Any, where: str) -> DatasetError | None:
        if not isinstance(value, dict):
            return DatasetError(f"{where}: row must be a JSON object, got {type(value).__name__}")
        for key in self.required_keys:
            if _absent(value, key):
                return DatasetError(f"{where}: key {key!r} is null" if key in value
                                    else f"{where}: missing required key {key!r}")
            types = self.key_types.get(key)
            if types and not isinstance(value[key], types):
                names = " or ".join(t.__name__ for t in types)
                chat = " (a list of chat messages needs chat_template: true)" if isinstance(value[key], list) else ""
                return DatasetError(f"{where}: key {key!r} must be {names}, got {type(value[key]).__name__}{chat}")
        return None

    def iterate(self, local_batch: int, epochs: int) -> Iterator[tuple[int, int, list[PromptRow]]]:
        """(epoch, step, rows) from the current position to the end of epoch ``epochs - 1``.

        Every rank yields the same number of steps per epoch (``steps_per_epoch(local_batch *
        world_size)``), some possibly empty. The position advances as each batch is yielded,
        so ``state_dict()`` taken after processing a batch resumes at the next one.
        """
        steps = self.steps_per_epoch(local_batch * self.world_size)
        while self._epoch < epochs:
            if self._step >= steps:
                self._epoch, self._step = self._epoch + 1, 0
                continue
            epoch, step = self._epoch, self._step
            rows = self.batch(epoch, step, local_batch)
            self._step += 1
            yield epoch, step, rows

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "step": self._step, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": self.num_rows, "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Continue from a saved position. The dataset, seed and sharding must be the same."""
        for key in ("epoch", "step"):
            if not isinstance(d.get(key), int) or d[key] < 0:
                raise ValueError(f"PromptShard state: {key!r} must be a non-negative int, got {d.get(key)!r}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_rows", self.num_rows),
                          ("world_size", self.world_size)):
            if key in d and d[key] != mine:
                raise ValueError(f"PromptShard state was saved with {key}={d[key]!r} but this loader has {mine!r}; "
                                 f"resuming would repeat or skip prompts")
        self._epoch, self._step = int(d["epoch"]), int(d["step"])
