"""SampleBatch: the unit of data that moves between DAG stages.

A columnar, ragged-packed batch of samples. Per-sample scalars are 1-D tensors of
length ``n``; variable-length fields (prompt tokens, response tokens and the per-token
values aligned with the response) are stored flat with a lengths tensor, so a batch is a
handful of contiguous tensors that the tensor channels move as zero-copy frames.

Every sample carries ``sample_id`` (unique within a run), ``prompt_id`` (the dataset row
it came from, as ``"e{epoch}:{row}"``) and ``policy_version`` (the weights that made it).

Two wire forms (:meth:`SampleBatch.from_wire` reads both): one tensor per field
(:meth:`SampleBatch.to_wire`), or *packed* (:class:`PackedPart`): every field at a 64-byte
aligned offset of one uint8 buffer, described by a ``[name, dtype, offset, count]`` layout in
the meta. A split writes each part packed, straight into the memory it travels in (a shared-
memory slot on one host), so a part is one buffer on the wire: the channel's per-tensor work
(headers, checks, views) is done once per part instead of once per field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

# Flat fields aligned with prompt tokens / response tokens, keyed by their lengths tensor.
PROMPT_FIELDS = ("prompt_tokens",)
RESPONSE_FIELDS = ("response_tokens", "logprobs", "ref_logprobs", "values", "old_logprobs", "token_advantages", "returns")
SCALAR_FIELDS = ("policy_version", "reward", "advantage", "truncated", "last_version")
LENGTHS = {"prompt_tokens": "prompt_lens", **{f: "response_lens" for f in RESPONSE_FIELDS}}
PACKED = "packed"  # meta key (the layout) and tensor name (the buffer) of the packed wire form
MAX_FIELDS = 256


@dataclass
class SampleBatch:
    """Ragged columnar batch. ``tensors`` holds flat ragged fields, ``*_lens`` and scalars."""

    sample_ids: list[str]
    prompt_ids: list[str]
    tensors: dict[str, torch.Tensor]
    extras: list[dict[str, Any]] = field(default_factory=list)  # per-sample msgpack-able info (answer, text)

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        if len(self.prompt_ids) != n:
            raise ValueError(f"SampleBatch: {n} sample_ids but {len(self.prompt_ids)} prompt_ids")
        if not self.extras:
            self.extras = [{} for _ in range(n)]
        if len(self.extras) != n:
            raise ValueError(f"SampleBatch: {n} samples but {len(self.extras)} extras")
        totals: dict[str, int] = {}  # each lengths tensor summed once (a tensor op costs a few us)
        for name, t in self.tensors.items():
            lens_name = LENGTHS.get(name)
            if lens_name is None:
                if t.dim() != 1 or t.shape[0] != n:
                    raise ValueError(f"SampleBatch field {name!r}: expected shape [{n}], got {list(t.shape)}")
            else:
                total = totals.get(lens_name)
                if total is None:
                    lens = self.tensors.get(lens_name)
                    if lens is None:
                        raise ValueError(f"SampleBatch field {name!r} needs {lens_name!r}")
                    total = totals[lens_name] = sum(lens.tolist())  # ~4x cheaper than a tensor sum
                if t.dim() != 1 or t.shape[0] != total:
                    raise ValueError(f"SampleBatch field {name!r}: expected {total} flat values, got {list(t.shape)}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_lists(
        cls,
        sample_ids: Sequence[str],
        prompt_ids: Sequence[str],
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]] | None = None,
        policy_version: Sequence[int] | int = 0,
        extras: Sequence[dict[str, Any]] | None = None,
    ) -> "SampleBatch":
        n = len(sample_ids)
        t: dict[str, torch.Tensor] = {
            "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
            "prompt_tokens": torch.tensor([x for p in prompts for x in p], dtype=torch.int64),
            "response_lens": torch.tensor([len(r) for r in responses], dtype=torch.int64),
            "response_tokens": torch.tensor([x for r in responses for x in r], dtype=torch.int64),
        }
        if logprobs is not None:
            t["logprobs"] = torch.tensor([x for lp in logprobs for x in lp], dtype=torch.float32)
        if isinstance(policy_version, int):
            t["policy_version"] = torch.full((n,), policy_version, dtype=torch.int64)
        else:
            t["policy_version"] = torch.tensor(list(policy_version), dtype=torch.int64)
        return cls(list(sample_ids), list(prompt_ids), t, list(extras) if extras else [])

    @classmethod
    def empty(cls) -> "SampleBatch":
        z = torch.zeros(0, dtype=torch.int64)
        return cls([], [], {"prompt_lens": z, "prompt_tokens": z.clone(), "response_lens": z.clone(),
                            "response_tokens": z.clone()})

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.sample_ids)

    def ragged(self, name: str) -> list[torch.Tensor]:
        """Per-sample views of a flat ragged field."""
        lens = self.tensors[LENGTHS[name]].tolist()
        return list(torch.split(self.tensors[name], lens)) if lens else []

    def num_tokens(self) -> torch.Tensor:
        """Tokens per sample (prompt + response), int64 [n]."""
        return self.tensors["prompt_lens"] + self.tensors["response_lens"]

    def nbytes(self) -> int:
        return sum([t.nbytes for t in self.tensors.values()])

    # A batch lives in host memory (routing, the wire forms and select() work on CPU tensors and
    # numpy views): a field a stage computed on the GPU is brought back here, once.
    def set_scalar(self, name: str, values: torch.Tensor) -> None:
        if values.shape != (len(self),):
            raise ValueError(f"{name}: expected shape [{len(self)}], got {list(values.shape)}")
        self.tensors[name] = values.cpu()

    def set_ragged(self, name: str, flat: torch.Tensor) -> None:
        expected = int(self.tensors[LENGTHS[name]].sum())
        if flat.shape != (expected,):
            raise ValueError(f"{name}: expected [{expected}] flat values, got {list(flat.shape)}")
        self.tensors[name] = flat.cpu()

    # ------------------------------------------------------------------ reshaping
    def select(self, indices: Sequence[int] | torch.Tensor) -> "SampleBatch":
        """A new batch holding the given samples, in the given order."""
        idx = torch.as_tensor(list(indices) if not torch.is_tensor(indices) else indices, dtype=torch.int64)
        out: dict[str, torch.Tensor] = {}
        gathers: dict[str, torch.Tensor] = {}  # one flat gather index per lengths field, vectorised
        for name, t in self.tensors.items():
            if name in LENGTHS:
                lens_name = LENGTHS[name]
                if lens_name not in gathers:
                    lens = self.tensors[lens_name]
                    sel_lens = lens[idx]
                    sel_starts = (torch.cumsum(lens, 0) - lens)[idx]
                    out_starts = torch.cumsum(sel_lens, 0) - sel_lens
                    total = int(sel_lens.sum())
                    gathers[lens_name] = torch.arange(total) + torch.repeat_interleave(sel_starts - out_starts,
                                                                                       sel_lens)
                out[name] = t[gathers[lens_name]]
            else:
                out[name] = t.index_select(0, idx) if len(idx) else t[:0].clone()
        il = idx.tolist()
        return SampleBatch([self.sample_ids[i] for i in il], [self.prompt_ids[i] for i in il], out,
                           [self.extras[i] for i in il])

    @classmethod
    def concat(cls, batches: Iterable["SampleBatch"]) -> "SampleBatch":
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls.empty()
        names = set(batches[0].tensors)
        for b in batches[1:]:
            if set(b.tensors) != names:
                raise ValueError(f"cannot concat batches with fields {sorted(names)} and {sorted(b.tensors)}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        return cls(
            [s for b in batches for s in b.sample_ids],
            [p for b in batches for p in b.prompt_ids],
            tensors,
            [e for b in batches for e in b.extras],
        )

    # ------------------------------------------------------------------ wire
    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(msgpack-able meta, named tensors) for a tensor channel. Never pickles."""
        meta = {"sample_ids": self.sample_ids, "prompt_ids": self.prompt_ids, "extras": self.extras}
        return meta, dict(self.tensors)

    @classmethod
    def from_wire(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "SampleBatch":
        """The batch of a received message, in either wire form (views of the received memory).
        Raises ValueError naming what is malformed."""
        if meta.get(PACKED) is not None:
            tensors = unpack_fields(meta[PACKED], tensors)
        try:
            return cls(list(meta["sample_ids"]), list(meta["prompt_ids"]), dict(tensors), list(meta.get("extras") or []))
        except KeyError as e:
            raise ValueError(f"SampleBatch wire meta lacks {e.args[0]!r}") from None


@dataclass
class PackedPart:
    """One part of a split in the packed wire form: ``buf`` (uint8 [>= nbytes]) holds every field at
    the offset its ``layout`` entry ``[name, dtype name, byte offset, element count]`` gives."""

    sample_ids: list[str]
    prompt_ids: list[str]
    extras: list[dict[str, Any]]
    buf: torch.Tensor
    layout: list[list[Any]]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def nbytes(self) -> int:
        """The fields' bytes (alignment padding not counted)."""
        from distflow.core.channels.codec import DTYPES

        return sum(count * DTYPES[dname].itemsize for _, dname, _, count in self.layout)

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        meta = {"sample_ids": self.sample_ids, "prompt_ids": self.prompt_ids, "extras": self.extras,
                PACKED: self.layout}
        return meta, {PACKED: self.buf}

    def to_batch(self) -> SampleBatch:
        """A SampleBatch whose fields view ``buf`` (no copy)."""
        return SampleBatch(self.sample_ids, self.prompt_ids, unpack_fields(self.layout, {PACKED: self.buf}),
                           self.extras)


def unpack_fields(layout: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Field tensors viewing the one packed buffer; checks the (untrusted) layout against it."""
    from distflow.core.channels.codec import DTYPES

    buf = tensors.get(PACKED)
    if len(tensors) != 1 or buf is None:
        raise ValueError(f"a packed batch carries one tensor {PACKED!r}, got {sorted(tensors)}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"the packed buffer must be a contiguous 1-D uint8 tensor, got {buf.dtype} {list(buf.shape)}")
    if not isinstance(layout, list) or len(layout) > MAX_FIELDS:
        raise ValueError(f"packed layout must be a list of at most {MAX_FIELDS} fields")
    size = buf.numel()
    arr = buf.numpy() if size else None
    out: dict[str, torch.Tensor] = {}
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ValueError(f"packed layout entry {entry!r} is not [name, dtype, offset, count]")
        name, dname, off, count = entry
        dtype = DTYPES.get(dname) if isinstance(dname, str) else None
        if not isinstance(name, str) or name in out or dtype is None:
            raise ValueError(f"packed field {name!r}: bad or repeated name, or unknown dtype {dname!r}")
        if not (type(off) is int and type(count) is int and off >= 0 and count >= 0
                and off % dtype.itemsize == 0 and off + count * dtype.itemsize <= size):
            raise ValueError(f"packed field {name!r}: offset {off!r} / count {count!r} do not fit the "
                             f"{size}-byte buffer")
        out[name] = torch.frombuffer(arr, dtype=dtype, count=count, offset=off) if count else torch.empty(0, dtype=dtype)
    return out
