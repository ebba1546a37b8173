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

import numpy as np
import torch

# Flat fields aligned with prompt tokens / response tokens, keyed by their lengths tensor.
PROMPT_FIELDS = ("prompt_tokens",)
# loss_mask (int64, 0/1): present only on multi-turn episodes (docs/agents.md): 1 on the tokens the engine
# sampled, 0 on observation, tool and template tokens; a batch without it trains every response token.
RESPONSE_FIELDS = ("response_tokens", "logprobs", "ref_logprobs", "values", "old_logprobs", "token_advantages", "returns",
                   "loss_mask")
SCALAR_FIELDS = ("policy_version", "reward", "advantage", "truncated", "last_version")
# A vision-language prompt's images (distflow/vision.py), present only when the model takes images: its
# pixel patches flat (float32, patches x patch_dim values) and its images' (t, h, w) patch grids flat (int64,
# 3 per image). Every sample of a prompt carries them, so they travel with it to whichever trainer owns it.
IMAGE_LENGTHS = {"pixel_values": "pixel_lens", "image_grid_thw": "image_grid_lens"}
LENGTHS = {"prompt_tokens": "prompt_lens", **{f: "response_lens" for f in RESPONSE_FIELDS}, **IMAGE_LENGTHS}
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
    def concat(cls, batches: Iterable["SampleBatch | PackedPart"]) -> "SampleBatch":
        """One batch of every sample of ``batches`` (SampleBatches or packed parts), in order: one
        copy of each field's bytes, straight out of a packed part's buffer (no per-part views)."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls.empty()
        return _join(batches)

    def field_bytes(self) -> dict[str, tuple[torch.dtype, np.ndarray]]:
        """{field: (dtype, its bytes as a uint8 numpy view)} (CPU fields; what :meth:`concat` copies)."""
        out = {}
        for name, t in self.tensors.items():
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            out[name] = (t.dtype, t.reshape(-1).view(torch.uint8).numpy())
        return out

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
    buf: torch.Tensor | np.ndarray  # uint8 (numpy: a same-host post's view of its producer's buffer)
    layout: list[list[Any]]
    size: int | None = None  # the fields' bytes, when known (check_packed computes it)
    post: Any = None  # the same-host post ``buf`` views (transport.movers.posting.Post): release() when done

    def __len__(self) -> int:
        return len(self.sample_ids)

    def nbytes(self) -> int:
        """The fields' bytes (alignment padding not counted)."""
        if self.size is None:
            from distflow.transport.codec import DTYPES

            self.size = sum(count * DTYPES[dname].itemsize for _, dname, _, count in self.layout)
        return self.size

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        meta = {"sample_ids": self.sample_ids, "prompt_ids": self.prompt_ids, "extras": self.extras,
                PACKED: self.layout}
        return meta, {PACKED: self.buf}

    def to_batch(self) -> SampleBatch:
        """A SampleBatch whose fields view ``buf`` (no copy; a post is released when they all die)."""
        buf = self.post.keep() if self.post is not None else self.buf
        buf = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
        return SampleBatch(self.sample_ids, self.prompt_ids, unpack_fields(self.layout, {PACKED: buf}), self.extras)

    def release(self) -> None:
        """Done with ``buf`` (its fields were copied out): a post's producer may reuse the memory."""
        if self.post is not None:
            self.post.release()

    def field_bytes(self) -> dict[str, tuple[torch.dtype, np.ndarray]]:
        """{field: (dtype, its bytes in ``buf``)}: uint8 numpy slices, no tensor per field (see
        :meth:`SampleBatch.concat`). The layout must have been checked (:func:`check_packed`)."""
        from distflow.transport.codec import DTYPES

        arr = self.buf if isinstance(self.buf, np.ndarray) else self.buf.numpy()
        return {name: (DTYPES[dname], arr[off:off + count * DTYPES[dname].itemsize])
                for name, dname, off, count in self.layout}


@dataclass(frozen=True)
class _Schema:
    """What a packed layout's field names and dtypes imply, checked once per distinct layout shape."""

    dtypes: tuple[torch.dtype, ...]
    itemsizes: tuple[int, ...]
    lens: tuple[int, ...]  # per field: the index of its lengths field, -1 for a per-sample field


_SCHEMAS: dict[tuple, _Schema] = {}


def _schema(names: tuple, dnames: tuple) -> _Schema:
    from distflow.transport.codec import DTYPES

    if len(names) > MAX_FIELDS or len(set(names)) != len(names) or not all(type(n) is str for n in names):
        raise ValueError(f"packed layout: field names must be distinct strings, got {list(names)[:8]}")
    dtypes = [DTYPES.get(d) if type(d) is str else None for d in dnames]
    if None in dtypes:
        raise ValueError(f"packed layout: unknown dtype in {list(dnames)[:8]}")
    index = {n: i for i, n in enumerate(names)}
    lens = []
    for name in names:
        lens_name = LENGTHS.get(name)
        if lens_name is None:
            lens.append(-1)
            continue
        if lens_name not in index:
            raise ValueError(f"SampleBatch field {name!r} needs {lens_name!r}")
        if dtypes[index[lens_name]] != torch.int64:
            raise ValueError(f"SampleBatch field {lens_name!r} must be int64")
        lens.append(index[lens_name])
    schema = _Schema(tuple(dtypes), tuple(d.itemsize for d in dtypes), tuple(lens))  # type: ignore[union-attr,arg-type]
    if len(_SCHEMAS) < 1024:  # (a run has a handful of shapes; never grow without bound)
        _SCHEMAS[(names, dnames)] = schema
    return schema


_ALIGN = 64
_PAD = np.zeros(_ALIGN, dtype=np.uint8)


def _join(batches: list[SampleBatch | PackedPart]) -> SampleBatch:
    """:meth:`SampleBatch.concat` of non-empty batches: every field's bytes out of every batch (a
    packed part's straight out of its buffer) into ONE buffer in ONE numpy copy (a call per field and
    part costs more than the bytes of a small step), then a 64-byte aligned view per field."""
    views = [b.field_bytes() for b in batches]
    first = views[0]
    for v in views[1:]:
        if v.keys() != first.keys():
            raise ValueError(f"cannot concat batches with fields {sorted(first)} and {sorted(v)}")
    srcs: list[np.ndarray] = []
    fields = []
    pos = 0
    for name, (dtype, _) in first.items():
        start = pos
        for v in views:
            d, a = v[name]
            if d != dtype:
                raise ValueError(f"cannot concat field {name!r} of different dtypes ({dtype} and {d})")
            srcs.append(a)
            pos += a.nbytes
        fields.append((name, dtype, start, (pos - start) // dtype.itemsize))
        if pos % _ALIGN:
            srcs.append(_PAD[:_ALIGN - pos % _ALIGN])
            pos += _ALIGN - pos % _ALIGN
    out = np.empty(pos, dtype=np.uint8)
    if pos:
        np.concatenate(srcs, out=out)
    tensors = {name: torch.frombuffer(out, dtype=dtype, count=n, offset=start) if n else torch.empty(0, dtype=dtype)
               for name, dtype, start, n in fields}
    return SampleBatch([s for b in batches for s in b.sample_ids], [q for b in batches for q in b.prompt_ids],
                       tensors, [e for b in batches for e in b.extras])


def _checked(layout: Any, buf: Any) -> tuple[tuple, tuple, tuple, _Schema]:
    """(names, byte offsets, counts, schema) of an (untrusted) packed layout, every entry checked to
    fit ``buf`` (a contiguous 1-D uint8 tensor, or a same-host post's numpy view); raises ValueError
    naming what is wrong. What the names and dtypes imply is worked out once per layout shape: this
    runs for every part a shard takes in."""
    if isinstance(buf, np.ndarray):
        size = buf.nbytes if buf.dtype == np.uint8 and buf.ndim == 1 else -1
    elif isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous():
        size = buf.numel()
    else:
        size = -1
    if size < 0:
        raise ValueError("the packed buffer must be a contiguous 1-D uint8 tensor")
    try:
        if type(layout) is not list:
            raise TypeError
        names, dnames, offs, counts = zip(*layout) if layout else ((), (), (), ())  # (an entry not of 4: ValueError)
        schema = _SCHEMAS.get((names, dnames)) or _schema(names, dnames)  # (unhashable names: TypeError)
    except (TypeError, ValueError) as e:
        raise ValueError(f"packed layout must be a list of [name, dtype, offset, count] entries "
                         f"({e or 'not a list'})") from None
    for off, count, item in zip(offs, counts, schema.itemsizes):
        if type(off) is not int or type(count) is not int or off < 0 or count < 0 or off % item \
                or off + count * item > size:
            raise ValueError(f"packed layout: offset {off!r} / count {count!r} do not fit the {size}-byte buffer")
    return names, offs, counts, schema


def check_packed(layout: Any, buf: Any, num_samples: int) -> int:
    """Check an (untrusted) packed part without building a tensor: its layout fits ``buf``, each
    ragged field's count is the sum of its lengths field, each per-sample field has one value per
    sample (what :class:`SampleBatch` checks). Returns its fields' bytes; raises ValueError naming
    what is wrong."""
    names, offs, counts, schema = _checked(layout, buf)
    arr = None
    totals: dict[int, int] = {}
    for i, li in enumerate(schema.lens):
        if li < 0:
            if counts[i] != num_samples:
                raise ValueError(f"SampleBatch field {names[i]!r}: expected shape [{num_samples}], got [{counts[i]}]")
            continue
        total = totals.get(li)
        if total is None:
            if arr is None:
                arr = buf if isinstance(buf, np.ndarray) else buf.numpy()
            total = totals[li] = sum(arr[offs[li]:offs[li] + 8 * counts[li]].view(np.int64).tolist())
        if counts[i] != total:
            raise ValueError(f"SampleBatch field {names[i]!r}: expected {total} flat values, got [{counts[i]}]")
    return sum([c * i for c, i in zip(counts, schema.itemsizes)])


def unpack_fields(layout: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Field tensors viewing the one packed buffer; checks the (untrusted) layout against it."""
    buf = tensors.get(PACKED)
    if len(tensors) != 1 or buf is None:
        raise ValueError(f"a packed batch carries one tensor {PACKED!r}, got {sorted(tensors)}")
    names, offs, counts, schema = _checked(layout, buf)
    arr = buf.numpy() if buf.numel() else None
    return {name: torch.frombuffer(arr, dtype=dtype, count=count, offset=off) if count else torch.empty(0, dtype=dtype)
            for name, dtype, off, count in zip(names, schema.dtypes, offs, counts)}
