"""A learned reward model: a local Hugging Face sequence-classification model scores samples.

Why this module exists: a REWARD MODEL_INFERENCE workflow node may run on the rollout
group or on the trainer group (and, once the runtime has a third kind of node, on a
group of its own); both executors use this one wrapper, so it lives beside the RL maths
that both groups share rather than in either group's package.

The model is ``AutoModelForSequenceClassification`` with ``num_labels == 1`` loaded from a
local directory (nothing is downloaded); it reads the policy's token ids (prompt +
response), so it must share the policy's tokenizer (checked when its directory has one). The
score of a sample is the head's output at the sample's last real token, computed here (right padding, positions from the
attention mask) rather than by the model's own pooling, which needs a pad id that never
occurs in real text.

A reward model is fine-tuned on ``apply_chat_template`` output, and for many templates that
ends one token past the end of the turn (Qwen's ``<|im_end|>\n``): its score was trained at the
newline, not at the ``<|im_end|>`` a policy stops on. So a response that ends with the template's
end-of-turn token gets the template's trailing ids appended before scoring (:func:`turn_suffix`,
from the reward model's tokenizer or else the policy's); a truncated response is scored as it is.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from distflow.device import COMPUTE_DTYPES, on_device

__all__ = ["RewardModel", "load_reward_model", "same_tokenizer", "score_batch", "turn_suffix"]

_CACHE: dict[tuple[str, str, str], "RewardModel"] = {}
_CACHE_LOCK = threading.Lock()
_SAME_TOKENIZER: set[tuple[str, str]] = set()  # (reward model dir, policy dir) pairs already checked


class RewardModel:
    """Frozen, eval-mode sequence-classification model: ``score(prompts, responses) -> [n]``."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 micro_batch_size: int = 64, suffix: tuple[int, tuple[int, ...]] | None = None):
        from transformers import AutoModelForSequenceClassification

        from distflow.hf import LOAD_LOCK, check_model_dir

        p = check_model_dir(path)
        with LOAD_LOCK:
            model = AutoModelForSequenceClassification.from_pretrained(str(p), dtype=dtype, local_files_only=True)
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {str(p)!r}: num_labels is {model.config.num_labels}, expected 1 "
                             f"(a scalar score)")
        self.base = getattr(model, model.base_model_prefix, None)
        self.head = getattr(model, "score", None)
        if self.base is None or not isinstance(self.head, torch.nn.Linear):
            raise ValueError(f"reward model {str(p)!r}: {type(model).__name__} has no base model "
                             f"({model.base_model_prefix!r}) and linear 'score' head")
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.vocab = int(model.config.vocab_size)
        self.micro_batch_size = micro_batch_size
        self.path = str(p)
        self.suffix = suffix  # (end-of-turn id, the ids its chat template writes after it): turn_suffix()

    @torch.no_grad()
    def score(self, prompts: Sequence[Tensor], responses: Sequence[Tensor],
              micro_batch_size: int | None = None) -> Tensor:
        """prompts[i] ``[P_i]``, responses[i] ``[R_i]`` int token ids -> scores ``[n]`` fp32 (cpu).
        Runs with the model's GPU as the calling thread's current device (it runs in worker threads)."""
        if len(prompts) != len(responses):
            raise ValueError(f"reward model: {len(prompts)} prompts but {len(responses)} responses")
        with on_device(self.device):
            return self._score(prompts, responses, micro_batch_size or self.micro_batch_size)

    def _score(self, prompts: Sequence[Tensor], responses: Sequence[Tensor], mbs: int) -> Tensor:
        out = []
        for s in range(0, len(prompts), mbs):
            seqs = [torch.cat([p.to(torch.int64), r.to(torch.int64)])
                    for p, r in zip(prompts[s:s + mbs], responses[s:s + mbs])]
            if self.suffix is not None:
                end, tail = self.suffix[0], torch.tensor(self.suffix[1], dtype=torch.int64)
                seqs = [torch.cat([q, tail]) if q.numel() and int(q[-1]) == end else q for q in seqs]
            for i, q in enumerate(seqs):
                if q.numel() == 0:
                    raise ValueError(f"reward model: sample {s + i} is empty")
                if int(q.max()) >= self.vocab:
                    raise ValueError(f"reward model {self.path!r}: token id {int(q.max())} of sample {s + i} is "
                                     f"outside its vocabulary ({self.vocab}); it must share the policy's tokenizer")
            width = max(q.numel() for q in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.int64)
            attn = torch.zeros_like(ids)
            for i, q in enumerate(seqs):
                ids[i, :q.numel()] = q
                attn[i, :q.numel()] = 1
            ids, attn = ids.to(self.device), attn.to(self.device)
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            hidden = self.base(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)[0]
            last = attn.sum(-1) - 1  # [b]
            h = hidden[torch.arange(len(seqs), device=hidden.device), last]  # [b, H]
            out.append(self._head_fp32(h)[:, 0].cpu())
        return torch.cat(out) if out else torch.zeros(0)


    def _head_fp32(self, h: Tensor) -> Tensor:
        """The score head in fp32 whatever the model's dtype: a bf16 score is rounded by up to ~0.03
        at |score| ~ 1, as large as the differences GRPO normalises within a group."""
        w, b = self.head.weight, getattr(self.head, "bias", None)
        return torch.nn.functional.linear(h.float(), w.float(), None if b is None else b.float())


def same_tokenizer(model_dir: str | Path, policy_dir: str | Path) -> None:
    """Raise ValueError when the reward model's directory has a tokenizer that is not the policy's
    (it scores the policy's token ids: another vocabulary would score nonsense, silently when
    its vocabulary is larger): every policy token must have the same id there; tokens the reward
    model adds (a pad token of its fine-tune) are fine. No tokenizer there: only the id bound
    of ``score`` applies."""
    key = (str(Path(model_dir).resolve()), str(Path(policy_dir).resolve()))
    if key in _SAME_TOKENIZER:
        return
    if has_tokenizer(model_dir):
        from distflow.hf import load_tokenizer

        ours, theirs = load_tokenizer(policy_dir).get_vocab(), load_tokenizer(model_dir).get_vocab()
        differ = sum(1 for t, i in ours.items() if theirs.get(t) != i)  # tokens it may add (a pad token) are fine
        if differ:
            raise ValueError(f"reward model {key[0]!r}: its tokenizer is not the policy's ({differ} of the policy's "
                             f"{len(ours)} tokens are missing or have another id there); a reward model reads the "
                             f"policy's token ids, so it must share the policy's tokenizer")
    _SAME_TOKENIZER.add(key)


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def turn_suffix(tokenizer: Any) -> tuple[int, tuple[int, ...]] | None:
    """(end-of-turn id, the ids after it) where the tokenizer's chat template ends a conversation's
    last assistant turn with a special token and then more (Qwen: ``<|im_end|>``, ``\n``); None when
    it ends on the special token itself (Llama 3's ``<|eot_id|>``), has no template, or is unusual
    (no special token at the end, or more than 4 ids after it)."""
    from distflow.hf import end_of_turn

    end = end_of_turn(tokenizer)
    return end if end is not None and 0 < len(end[1]) <= 4 else None


def load_reward_model(path: str, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                      tokenizer_dir: str | None = None) -> RewardModel:
    """One RewardModel per (path, device, dtype) per process, loaded on first use; its
    :func:`turn_suffix` comes from the tokenizer in ``path``, else the one in ``tokenizer_dir``."""
    key = (str(Path(path).resolve()), str(device), str(dtype))
    with _CACHE_LOCK:
        if key not in _CACHE:
            source = next((d for d in (path, tokenizer_dir) if d is not None and has_tokenizer(d)), None)
            suffix = None
            if source is not None:
                from distflow.hf import load_tokenizer

                suffix = turn_suffix(load_tokenizer(source))
            _CACHE[key] = RewardModel(path, device, dtype, suffix=suffix)
        return _CACHE[key]


def score_batch(node: Any, batch: Any, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                policy_path: str | None = None) -> Any:
    """A REWARD MODEL_INFERENCE node on any group. ``node.args``: ``path`` (a local
    sequence-classification model dir), optional ``weight`` (default 1), ``dtype`` (float32,
    bfloat16 or float16: the model's weights and compute; default ``dtype``, which the
    executors pass as the run's compute dtype; the score head runs in fp32 either way) and
    ``micro_batch_size`` (samples per forward, default 64; lower it for long sequences on a
    GPU). With ``policy_path``, a reward model directory holding a tokenizer must hold the
    policy's. The weighted score is added to an existing ``reward`` (a rule-based one that ran
    before) or becomes it. Raises ValueError naming the node and the key."""
    path = node.args.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"workflow node {node.id!r}: a reward model needs args.path (a local model directory)")
    name, mbs = node.args.get("dtype"), node.args.get("micro_batch_size")
    if name is not None and name not in COMPUTE_DTYPES:
        raise ValueError(f"workflow node {node.id!r}: args.dtype {name!r} must be one of {', '.join(COMPUTE_DTYPES)}")
    if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
        raise ValueError(f"workflow node {node.id!r}: args.micro_batch_size {mbs!r} must be an integer >= 1")
    try:
        weight = float(node.args.get("weight", 1.0))
        if policy_path is not None:
            same_tokenizer(path, policy_path)
        rm = load_reward_model(path, device, COMPUTE_DTYPES[name] if name is not None else dtype, policy_path)
        scores = rm.score(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"), mbs) * weight
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ValueError(f"workflow node {node.id!r}: {e}") from None
    prev = batch.tensors.get("reward")
    batch.set_scalar("reward", scores if prev is None else prev.float() + scores)
    return batch
