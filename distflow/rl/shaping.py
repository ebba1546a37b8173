"""Reward shaping and advantage post-processing that every executor applies the same way.

Why this module exists: the rollout group (outcome estimators) and the trainer group
(GAE, trainer-side estimators) must shape rewards identically: DAPO's soft overlong
punishment is added to the outcome reward that feeds the advantage (the logged
``reward`` stays the task score), and ``overlong: mask`` removes truncated samples from
the policy loss: zero advantage, no tokens in the loss mask, none in its normalisers, none
in the whitening statistics (GAE's, REINFORCE++'s token and outcome forms). Both groups
import this module; neither imports the other.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from distflow.buffer.batch import SampleBatch
from distflow.core.config import Config
from distflow.rl.advantages import overlong_penalty

__all__ = ["group_index", "outcome_rewards", "mask_truncated", "trained_samples", "trained_token_counts",
           "response_loss_mask", "trained_token_mask", "sampled_token_counts", "split_episodes", "split_names"]


def group_index(prompt_ids: Sequence[str]) -> Tensor:
    """[n] int64 group ids: samples of one prompt share an id (first-appearance order)."""
    index = {p: i for i, p in enumerate(dict.fromkeys(prompt_ids))}
    return torch.tensor([index[p] for p in prompt_ids], dtype=torch.int64)


def outcome_rewards(batch: SampleBatch, cfg: Config) -> Tensor:
    """The reward an advantage is computed from: ``reward`` [n] plus, with ``overlong: penalty``,
    :func:`~distflow.rl.advantages.overlong_penalty` of the response lengths."""
    if "reward" not in batch.tensors:
        raise ValueError("no 'reward' field: a REWARD node must run before an advantage node")
    r = batch.tensors["reward"].float()
    if cfg.overlong == "penalty":
        r = r + overlong_penalty(batch.tensors["response_lens"], cfg.max_new_tokens, cfg.overlong_buffer)
    return r


def mask_truncated(advantages: Tensor, batch: SampleBatch, cfg: Config) -> Tensor:
    """With ``overlong: mask``, truncated samples get advantage 0 (no policy gradient).
    advantages: [n] or per-sample rows of any trailing shape."""
    keep = trained_samples(batch, cfg).to(advantages.dtype)
    return advantages * keep.reshape((-1,) + (1,) * (advantages.dim() - 1))


def trained_samples(batch: SampleBatch, cfg: Config) -> Tensor:
    """[n] bool: the samples the policy loss trains on: all of them, or with ``overlong: mask``
    the ones that were not truncated (DAPO's overlong filtering: a truncated sample adds no
    token to the loss and none to its token or sequence counts, so the others' gradient is
    not diluted by the text that was cut off)."""
    n = len(batch)
    if cfg.overlong != "mask" or "truncated" not in batch.tensors:
        lens = batch.tensors.get("response_lens")
        return torch.ones(n, dtype=torch.bool, device=None if lens is None else lens.device)
    return batch.tensors["truncated"].reshape(n) == 0


def response_loss_mask(batch: SampleBatch) -> Tensor | None:
    """Flat [sum(response_lens)] bool: the response tokens the engine sampled (a multi-turn
    episode's ``loss_mask``: its observation, tool and template tokens are 0), or None when the
    batch has no ``loss_mask`` (single-turn: every response token is sampled, and callers keep
    their unmasked arithmetic, bit for bit)."""
    m = batch.tensors.get("loss_mask")
    return None if m is None else m != 0


def trained_token_mask(batch: SampleBatch, cfg: Config) -> Tensor:
    """Flat [sum(response_lens)] bool: the response tokens the policy loss trains on (those of
    :func:`trained_samples`, and of an episode only the sampled ones, :func:`response_loss_mask`).
    The loss's entropy and the step's token statistics (advantages, the engine's logprob
    mismatch) are taken over exactly these tokens."""
    lens = batch.tensors["response_lens"]
    keep = torch.repeat_interleave(trained_samples(batch, cfg).to(lens.device), lens)
    sampled = response_loss_mask(batch)
    return keep if sampled is None else keep & sampled.to(keep.device)


def trained_token_counts(batch: SampleBatch, cfg: Config) -> Tensor:
    """[n] int64: each sample's response tokens that the policy loss trains on (0 for a sample
    :func:`trained_samples` leaves out; only the sampled ones of an episode, see
    :func:`response_loss_mask`). The weights of a token-weighted whitening (outcome REINFORCE++),
    so a truncated sample is out of its statistics as it is out of the token form's."""
    lens = sampled_token_counts(batch)
    return lens * trained_samples(batch, cfg).to(lens.device)


def sampled_token_counts(batch: SampleBatch) -> Tensor:
    """[n] int64: each sample's response tokens the engine sampled (``response_lens`` itself for a
    batch without ``loss_mask``)."""
    lens = batch.tensors["response_lens"]
    mask = response_loss_mask(batch)
    if mask is None:
        return lens
    index = torch.repeat_interleave(torch.arange(len(batch), device=lens.device), lens)
    return torch.zeros(len(batch), dtype=torch.int64, device=lens.device).index_add_(0, index, mask.long())



def split_episodes(batch: SampleBatch) -> tuple[list[int], Tensor] | None:
    """Where a multi-turn episode was split into several samples (``extras["episode"]`` shared,
    docs/agents.md): (the first sample of each episode, [n] int64 episode index of each sample),
    so an outcome estimator sees each episode once and its samples share its advantage. None
    when every sample is its own episode (single-turn samples, unsplit episodes)."""
    return split_names([e.get("episode") for e in batch.extras])


def split_names(names: list[Any]) -> tuple[list[int], Tensor] | None:
    """:func:`split_episodes` over the samples' episode names (None for a sample of no episode):
    also what a trainer-side estimator gathers from every rank, where one episode's samples are
    counted once over the whole step."""
    if not names or None in names or len(set(names)) == len(names):
        return None
    index: dict[str, int] = {}
    firsts, inverse = [], []
    for i, name in enumerate(names):
        if name not in index:
            index[name] = len(firsts)
            firsts.append(i)
        inverse.append(index[name])
    return firsts, torch.tensor(inverse, dtype=torch.int64)
