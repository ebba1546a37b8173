"""The one table of tracker names: a metrics.jsonl key -> verl's name for the same figure.

Why: users come from verl with dashboards, alerts and habits built on its names
(``response_length/mean``, ``actor/pg_clipfrac``, ``perf/mfu/actor``), and a run's figures should
be found under them in TensorBoard, W&B and MLflow. metrics.jsonl keeps the project's flat keys
(the tests, the plots and the progress bar read them); each tracker backend renames a step's
metrics through :func:`tracker_name` here, and nowhere else. A key is listed only where verl
measures the same thing (docs/metrics.md says where the two differ in detail); the others keep
their flat key, under ``train/`` in TensorBoard and W&B, as before.
"""

from __future__ import annotations

__all__ = ["VERL_NAMES", "TRAIN_PREFIX", "tracker_name", "verl_groups"]

TRAIN_PREFIX = "train/"  # TensorBoard's and W&B's group of a step's metrics that verl has no name for

VERL_NAMES: dict[str, str] = {
    # the step's samples (verl: metric_utils.compute_data_metrics)
    "response_len_mean": "response_length/mean", "response_len_max": "response_length/max",
    "response_len_min": "response_length/min", "truncated_frac": "response_length/clip_ratio",
    "prompt_len_mean": "prompt_length/mean", "prompt_len_max": "prompt_length/max",
    "prompt_len_min": "prompt_length/min",
    "reward_mean": "critic/score/mean", "reward_max": "critic/score/max", "reward_min": "critic/score/min",
    "advantage_mean": "critic/advantages/mean", "advantage_max": "critic/advantages/max",
    "advantage_min": "critic/advantages/min",
    # the policy update (verl: the actor's update_policy)
    "pg_loss": "actor/pg_loss", "clip_frac": "actor/pg_clipfrac", "approx_kl": "actor/ppo_kl",
    "kl": "actor/kl_loss", "entropy": "actor/entropy", "grad_norm": "actor/grad_norm", "lr": "actor/lr",
    "vf_loss": "critic/vf_loss", "vf_clip_frac": "critic/vf_clipfrac", "vf_grad_norm": "critic/grad_norm",
    "critic_value_mean": "critic/vpred_mean",
    # the engine's logprobs against the trainer's (verl: rollout_corr)
    "logprob_diff_mean": "rollout_corr/kl", "logprob_kl_k3": "rollout_corr/k3_kl",
    # time and throughput (verl: compute_timing_metrics, compute_throughout_metrics, the actor's perf/)
    "time_generate_s": "timing_s/gen", "time_update_s": "timing_s/update_actor", "time_reward_s": "timing_s/reward",
    "time_compute_s": "timing_s/adv", "time_weights_s": "timing_s/update_weights", "step_time_s": "timing_s/step",
    "throughput": "perf/throughput", "mfu": "perf/mfu/actor", "max_memory_allocated_gb": "perf/max_memory_allocated_gb",
}


def tracker_name(key: str, prefix: str = TRAIN_PREFIX) -> str:
    """A step metric's name in a tracker: verl's where it has one, else ``prefix`` + the flat key."""
    return VERL_NAMES.get(key) or prefix + key


def verl_groups() -> list[str]:
    """The top-level groups of verl's names (``actor``, ``critic``, ...): W&B plots them against
    ``train/step``, as it does ``train/*``."""
    return sorted({name.split("/", 1)[0] for name in VERL_NAMES.values()})
