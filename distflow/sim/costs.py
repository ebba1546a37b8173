"""What the model assumes about GPUs, workloads and the network: every number here is an input, not a measurement.

Why a table: the paper's runs used GPUs this project has never been lent, so their speed can
only be stated, not measured. A cost table says how fast one GPU generates and trains for a
model size (round figures for an H100/H800-class GPU in bf16: decode at large batch, and the
update's forward + backward plus the reference and old-logprob forwards, 10 x params FLOPs a
token, at about 40% MFU); a workload says how many samples a worker makes per step and how
their lengths are spread (RL responses are long-tailed: most short, a few at the length cap);
the network says what links join hosts. Change them to your hardware; the scaling conclusions
move with their ratios (compute per byte moved), which ``bench/scale.py`` prints.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class CostTable:
    """One model size on one GPU. Rates are tokens per second per GPU."""

    name: str
    params: float  # parameter count
    gen_tok_s: float  # generated tokens/s of one GPU's engine at full batch (continuous batching)
    seq_tok_s: float  # decode speed of one sequence (the longest response bounds a worker's generation)
    prefill_tok_s: float  # prompt tokens/s
    train_tok_s: float  # tokens/s through reference + old logprobs + update (fwd + bwd)


# Assumed, not measured (no GPU here): H100-class, bf16, about 40% MFU for training
# (989 TFLOP/s x 0.4 / (10 x params) tokens/s), decode throughput at large batch.
TABLES = {
    "7b": CostTable("7b", 7.6e9, gen_tok_s=4000.0, seq_tok_s=80.0, prefill_tok_s=40000.0, train_tok_s=5200.0),
    "32b": CostTable("32b", 32.5e9, gen_tok_s=900.0, seq_tok_s=35.0, prefill_tok_s=9000.0, train_tok_s=1200.0),
}


@dataclass(frozen=True)
class Workload:
    """One step's samples per worker (weak scaling: the global batch grows with the workers).

    Response lengths: lognormal, median ``median_frac`` of the cap, ``sigma`` spread, cut to
    [16, max_response] (a capped long tail). Bytes per sample as the data plane carries them:
    int64 prompt and response tokens, fp32 logprobs and an fp32 loss mask per response token
    (as ``bench/redistribute.py``'s payload), and the per-sample scalars."""

    sample_tokens: int = 8192  # prompt + response cap
    prompts_per_worker: int = 2
    group_size: int = 8  # samples per prompt (a GRPO group stays on one rollout worker)
    prompt_frac: float = 0.125
    median_frac: float = 0.25
    sigma: float = 1.0
    prompt_bytes_per_token: int = 8
    response_bytes_per_token: int = 16
    scalar_bytes: int = 48  # lengths, versions, truncated (int64), reward and advantage (fp32)

    @property
    def prompt_len(self) -> int:
        return max(1, int(self.sample_tokens * self.prompt_frac))

    @property
    def max_response(self) -> int:
        return self.sample_tokens - self.prompt_len

    @property
    def samples_per_worker(self) -> int:
        return self.prompts_per_worker * self.group_size

    def response_lengths(self, rng: random.Random, n: int) -> list[int]:
        mu = math.log(self.median_frac * self.max_response)
        return [min(self.max_response, max(16, int(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]

    def sample_bytes(self, response_len: int) -> int:
        return self.prompt_len * self.prompt_bytes_per_token + response_len * self.response_bytes_per_token \
            + self.scalar_bytes

    def replace(self, **kw) -> "Workload":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Network:
    """Hosts of ``gpus_per_host`` workers joined by ``nics_per_host`` NICs each (``inter_gbps`` each,
    each direction, ``latency_s`` one way); inside a host, shared memory (``intra_gbps``) and NVLink for weights."""

    gpus_per_host: int = 8
    inter_gbps: float = 200.0  # one NIC, each direction
    nics_per_host: int = 8  # GPU hosts: one NIC per GPU (HGX-style); the controller's host has ``ctrl_nics``
    latency_s: float = 10e-6
    intra_gbps: float = 400.0  # host memory bandwidth a same-host post's bytes see (copy)
    nvlink_gbps: float = 3600.0  # collectives and weight sync inside a host
    collective_overlap: float = 0.9  # fraction of FSDP's per-step collectives hidden under compute

    @property
    def inter_bytes_s(self) -> float:
        return self.inter_gbps * 1e9 / 8

    @property
    def nvlink_bytes_s(self) -> float:
        return self.nvlink_gbps * 1e9 / 8

    def replace(self, **kw) -> "Network":
        return dataclasses.replace(self, **kw)
