"""Variable-length (varlen) attention for packed rows: no attention across samples, no
O(row^2) mask.

Why it exists: a packed micro-batch is one row of several samples. Hugging Face can mask
it block-diagonally from the position ids, but with SDPA that is a dense [row, row] mask
and dense attention over the whole row: for a 1,024-token row of 24 samples ~20x the
attention work of the samples themselves, which eats most of what packing saves. So the
trainer's models use the attention implementation registered here, ``distflow_varlen``:

* packed rows (the caller passes ``cu_seq_lens_q``, the int32 [n + 1] cumulative sample
  lengths, through the model's kwargs): on CUDA ``torch.nn.attention.varlen.varlen_attn``
  (FlashAttention varlen, causal) in bf16/fp16; elsewhere (CPU, fp32) one causal
  ``scaled_dot_product_attention`` per sample (on CUDA with K/V repeated to the query
  heads, so the memory-efficient kernel, which takes no GQA, serves it rather than the math
  kernel). Attention work is sum(L_i^2), never row^2.
  The sample lengths also come as host ints (``distflow_seq_lens``), so no layer reads
  them back from the GPU. A model's ``sliding_window`` is honoured on both (FlashAttention's
  ``window_size``, a banded mask for SDPA), as transformers' padded path does;
* right-padded rows (the trainer's padded micro-batches, :func:`packing.pad_inputs`): ONE causal
  SDPA over the ``[B, S]`` batch, no padding mask. Causality alone gives every real token
  exactly what the padding mask gives it (its row's pads all come after it); a pad's output is
  never read. transformers would build a dense ``[B, 1, S, S]`` mask instead, whose memory
  grows as S^2 (1 GiB as fp32 at B=4, S=8k) and which keeps SDPA off FlashAttention. A
  sliding window gets one ``[S, S]`` band shared by the rows.

The mask builder registered under the same name returns no mask when there is no padding
mask, else SDPA's mask (a caller that builds its masks through transformers). The trainer's
callers give every micro-batch an empty 4-D mask (:func:`model_attention_mask`): transformers
returns a 4-D mask as it is, so it skips its scan of the position ids for packed sequences,
whose ``.all()`` would otherwise make the CPU wait for the GPU once per forward.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Collection, Mapping

import torch
import torch.nn.functional as F

from distflow.core.once import log_once
from distflow.trainer.packing import SEQ_LENS_KWARG, SP_GROUP_KWARG
from distflow.trainer.ulysses import ulysses_attention

log = logging.getLogger(__name__)

__all__ = ["VARLEN", "model_attention_mask", "register_varlen_attention", "unsupported_attention",
           "use_varlen_attention", "varlen_attention"]

VARLEN = "distflow_varlen"
# Attention options some models pass that neither FlashAttention varlen nor SDPA take: refused, not dropped.
UNSUPPORTED_KWARGS = {"softcap": "attention logit soft-capping, e.g. Gemma 2's attn_logit_softcapping",
                      "s_aux": "attention sinks, e.g. gpt-oss"}


def use_varlen_attention(model: Any, source: str) -> None:
    """Give the Hugging Face ``model`` (loaded from ``source``) the trainer's attention; a model
    whose attention it cannot compute (:func:`unsupported_attention`) is refused, naming why."""
    if (why := unsupported_attention(model.config)) is not None:
        raise ValueError(f"{source!r}: {why}")
    model.set_attn_implementation(register_varlen_attention())


def unsupported_attention(config: Any) -> str | None:
    """Why the trainer's attention cannot train a model of ``config`` (known from its config
    alone), or None. Checked when the trainer loads the model, before any step."""
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        return (f"model config attn_logit_softcapping={cap!r}: the trainer's attention ({VARLEN}: FlashAttention "
                f"varlen / SDPA) has no attention logit soft-capping, so its logprobs would not be the model's")
    return None


def varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, Hq, S, D], key/value [B, Hkv, S, D] -> ([B, S, Hq, D], None), like
    transformers' attention functions. With ``cu_seq_lens_q`` (int32 [n + 1]) B must be 1
    and the row holds n causally-masked samples (``distflow_seq_lens``: their lengths as
    ints; ``sliding_window``: the model's window, applied within each sample). Without it, an
    empty ``attention_mask`` (:func:`model_attention_mask`) means B right-padded rows: causal
    attention over each row; any other mask goes to transformers' SDPA as it is. With ``distflow_sp_group``
    (sequence parallelism) the inputs are this rank's slice of the row: Ulysses' all-to-alls around
    this attention (:func:`distflow.trainer.ulysses.ulysses_attention`)."""
    group = kwargs.pop(SP_GROUP_KWARG, None)
    if group is not None:
        return ulysses_attention(varlen_attention, module, query, key, value, attention_mask, group, dropout=dropout,
                                 scaling=scaling, cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for opt, what in UNSUPPORTED_KWARGS.items():  # dropping them would train another model than the engine samples
        if kwargs.get(opt) is not None:
            raise NotImplementedError(f"{type(module).__name__} calls its attention with {opt}= ("
                                      f"{what}), which the trainer's attention ({VARLEN}) does "
                                      f"not implement: its logprobs would not be the model's")
    lens = kwargs.pop(SEQ_LENS_KWARG, None)  # packed rows: the sample lengths as host ints
    # transformers' sliding window: query i sees keys i - window + 1 .. i
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and window > 0 else None
    if cu_seq_lens_q is None:
        if attention_mask is not None and attention_mask.numel() == 0:  # model_attention_mask's: right-padded rows
            n = query.shape[2]
            banded = window is not None and n > window
            # FlashAttention takes GQA, but only half precision and no mask
            expand = query.is_cuda and (banded or query.dtype == torch.float32)
            if expand and query.shape[1] != key.shape[1]:
                log_once(log, "trainer-gqa-repeat", logging.WARNING, "trainer attention: %s GQA keys are repeated "
                         "to the query heads for the memory-efficient kernel (%s), slower than FlashAttention",
                         query.dtype, "a sliding window" if banded else "fp32")
            key, value, gqa = _expand_kv(query, key, value, expand)
            out = _causal_sdpa(query, key, value, n, window, scaling, gqa)
            return out.transpose(1, 2).contiguous(), None
        kwargs.pop("cu_seq_lens_k", None), kwargs.pop("max_length_k", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention: a packed batch is one row, got {query.shape[0]} rows")
    if not lens:  # a caller without them: one host sync
        bounds = cu_seq_lens_q.tolist()
        lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    lens = [int(n) for n in lens]
    gqa = query.shape[1] != key.shape[1]
    flash = _flash_varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    kw = None if flash is None else varlen_kwargs(flash[1], scaling, query.shape[-1], window, gqa)
    if flash is not None and kw is not None:  # FlashAttention's dtypes, on a torch whose kernel does this call
        cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
        longest = int(max_length_q) if max_length_q is not None else max(lens, default=0)
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [S, H, D]
        out = flash[0](q, k, v, cu, cu, longest, longest, **kw)
        return out.unsqueeze(0), None
    why = ("not on CUDA" if not query.is_cuda else f"{query.dtype} (FlashAttention is fp16/bf16 only)"
           if query.dtype not in (torch.float16, torch.bfloat16) else "this torch has no varlen FlashAttention"
           if flash is None else "this torch's varlen kernel cannot take this call (scale, window or GQA)")
    log_once(log, f"trainer-per-sample-sdpa:{why}", logging.WARNING if query.is_cuda else logging.INFO,
             "trainer attention: packed rows attend one SDPA call per sample (%s), slower than one varlen "
             "FlashAttention call", why)
    return _per_sample_sdpa(query, key, value, lens, window, scaling, expand_kv=gqa and query.is_cuda), None


def _per_sample_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int],
                     window: int | None, scaling: float | None, expand_kv: bool) -> torch.Tensor:
    """One causal (or banded) SDPA per sample of a packed row -> [1, S, Hq, D]."""
    key, value, gqa = _expand_kv(query, key, value, expand_kv)
    # split (not slicing): its backward is one concatenation, not a zero-filled full-size
    # gradient per sample
    qs, ks, vs = (t.split(lens, dim=2) for t in (query, key, value))
    pieces = [_causal_sdpa(q, k, v, n, window, scaling, gqa) for q, k, v, n in zip(qs, ks, vs, lens) if n > 0]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous()


def _expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               expand: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(key, value, gqa left to SDPA). ``expand`` repeats K/V to the query heads instead of
    ``enable_gqa`` (on CUDA only FlashAttention and the math kernel take GQA, so an fp32 or masked
    call would fall to the math kernel and keep an fp32 [Hq, n, n] score matrix per sample for
    backward; the memory-efficient kernel takes the repeated heads), as transformers' SDPA path does."""
    gqa = query.shape[1] != key.shape[1]
    if gqa and expand:
        rep = query.shape[1] // key.shape[1]  # query head h reads KV head h // rep (HF's repeat_kv)
        return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1), False
    return key, value, gqa


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, window: int | None,
                 scaling: float | None, gqa: bool) -> torch.Tensor:
    """[B, Hq, n, D] attention of n positions, causal (banded by ``window`` when it bites)."""
    if window is not None and n > window:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(n, window, q.device), is_causal=False,
                                              scale=scaling, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)


def _band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, n] bool: causal, and each query sees at most ``window`` keys (itself included)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


@functools.lru_cache(maxsize=1)
def _flash_varlen() -> tuple[Any, frozenset[str]] | None:
    """torch's FlashAttention varlen kernel and its keyword names, or None on a torch without it
    (then per-sample SDPA). Its keywords changed across torch releases (``is_causal`` before
    ``window_size``/``enable_gqa``/``scale``), so calls are built by :func:`varlen_kwargs`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_kwargs(params: Collection[str], scaling: float | None, head_dim: int, window: int | None,
                  gqa: bool) -> dict[str, Any] | None:
    """Keywords for a causal ``varlen_attn`` call on a torch whose kernel takes ``params``, or
    None when it cannot do this one (a scale other than 1/sqrt(head_dim) it cannot take, a
    sliding window, or GQA it cannot be told about): per-sample SDPA then."""
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim ** -0.5) > 1e-9 * head_dim ** -0.5:
        return None
    if "window_size" in params:  # (left, right): -1 = unbounded; right 0 = causal
        kw["window_size"] = (-1 if window is None else window - 1, 0)
    elif "is_causal" in params and window is None:
        kw["is_causal"] = True
    else:
        return None
    if gqa:
        if "enable_gqa" not in params and "window_size" in params:
            return None  # a release that checks head counts unless told
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
    return kw


def _varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None  # packed (cu_seq_lens) or unpadded: causal structure is handled by varlen_attention
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def model_attention_mask(config: Any, attention_mask: torch.Tensor | None, attention: Mapping[str, Any],
                         device: torch.device) -> torch.Tensor | None:
    """The ``attention_mask`` to give a decoder whose config is ``config``, for a micro-batch with
    this padding mask (None: packed or unpadded; else RIGHT-padded rows, as
    :func:`packing.pad_inputs` makes them) and these varlen kwargs (``attention``:
    ``ModelInputs.attention_kwargs()``).

    Under ``distflow_varlen``: an empty 4-D bool mask, never read as a mask. Packed rows carry
    their structure in the cumulative lengths; padded rows need causality alone (see the module
    docstring). Transformers hands a 4-D mask through unchanged, so it builds no dense mask and
    skips ``find_packed_sequence_indices``, whose ``.all()`` is a host sync per forward.
    Transformers' own attention implementations get ``attention_mask`` back unchanged."""
    if getattr(config, "_attn_implementation", None) == VARLEN:
        return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)
    return attention_mask


def register_varlen_attention() -> str:
    """Register ``distflow_varlen`` with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, _varlen_mask)
    return VARLEN
