"""Mixed precision on FSDP2 (gloo, CPU): fp32 master weights and optimizer state, bf16 compute.

With ``dtype: bfloat16`` the parameters FSDP2 all-gathers for forward/backward are bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, which gloo supports), but
the sharded master weights, their gradients and AdamW's moments stay fp32. So an lr-1e-6
step moves the fp32 weights by what an fp32 step does, where a bf16 master copy would have
rounded most of that update away. Also: dropout is off in the trainer's forward, and the
Hugging Face checkpoint holds the fp32 master weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from distflow.core.config import load_config
from tests.conftest import ROOT
from tests.process_group import process_group, store_path
from tests.test_packing import make_batch


def _cfg(toy_model, *overrides):
    return load_config(ROOT / "examples" / "grpo_quickstart.yaml",
                       [f"model_path={toy_model}", "toy_model=false", "micro_batch_size=4", "grad_clip=1e6",
                        "kl_coef=0", "lr=1e-6", *overrides])


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    with process_group(store_path(tmp_path_factory.mktemp("pg"))):
        yield


def _step(toy_model, dtype):
    from distflow.trainer.actor import Actor

    cfg = _cfg(toy_model, f"dtype={dtype}", "max_tokens_per_micro_batch=24")
    actor = Actor(cfg, with_reference=False)
    before = actor.full_state_dict()
    stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=11))
    return actor, before, actor.full_state_dict(), stats


def test_bf16_compute_step_moves_fp32_masters_like_an_fp32_step(toy_model, world1, tmp_path):
    _, before, after32, _ = _step(toy_model, "float32")
    actor, before16, after16, stats = _step(toy_model, "bfloat16")
    assert stats["grad_norm"] > 0
    moved = lost = total = 0
    diff2 = ref2 = 0.0
    for name, w0 in before.items():
        assert before16[name].dtype == after16[name].dtype == torch.float32, name  # fp32 masters
        assert torch.equal(w0, before16[name])
        d32, d16 = after32[name] - w0, after16[name] - w0
        diff2 += float((d16 - d32).pow(2).sum())
        ref2 += float(d32.pow(2).sum())
        moved += int((d16 != 0).sum())
        # ...which a bf16 master copy would round away (spacing ~1e-4 at |w| ~ 0.02)
        w_bf16 = w0.to(torch.bfloat16)
        lost += int(((w_bf16.float() + d32).to(torch.bfloat16) == w_bf16).sum())
        total += w0.numel()
    # Adam's first step is ~lr * sign(grad): bf16-compute gradients give (nearly) the same update
    assert (diff2 / ref2) ** 0.5 < 0.2, (diff2 / ref2) ** 0.5
    assert moved / total > 0.9
    assert lost / total > 0.9, lost / total

    # AdamW state is fp32, in memory and in the saved checkpoint; the HF checkpoint is fp32 masters
    for state in actor.optim.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    out = tmp_path / "ckpt"
    from distflow.trainer.stages import TrainerContext, save_checkpoint

    save_checkpoint(TrainerContext(actor.cfg, actor=actor, critic=None, rank=0), out, after16, {"step": 1})
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(out / "optimizer")).read_metadata().state_dict_metadata
    dtypes = {m.properties.dtype for k, m in meta.items() if hasattr(m, "properties") and "exp_avg" in k}
    assert dtypes == {torch.float32}
    assert json.loads((out / "distflow_state.json").read_text())["policy_version"] == 1
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert loaded.dtype == torch.float32
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, after16[name]), name


def test_dropout_is_off_in_the_trainer_forward(toy_model, world1, tmp_path):
    """A model directory with attention dropout 0.5: the actor's forward is deterministic and
    equals the eval-mode model's (what the rollout engine samples from)."""
    import shutil

    from distflow.hf import load_causal_lm
    from distflow.trainer.actor import Actor
    from distflow.trainer.head import response_forward
    from distflow.trainer.packing import pack_inputs

    model_dir = tmp_path / "dropout-model"
    shutil.copytree(toy_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (model_dir / "config.json").write_text(json.dumps(config))
    actor = Actor(_cfg(model_dir), with_reference=False)
    assert actor.model.training
    batch = make_batch(4, seed=2)
    inputs = pack_inputs(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"))
    with torch.no_grad():
        a, _ = actor.model.response_forward(inputs, 1.0, 64)
        b, _ = actor.model.response_forward(inputs, 1.0, 64)
        plain = load_causal_lm(model_dir, torch.float32).eval()
        expect, _ = response_forward(plain, inputs)
    assert torch.equal(a, b)
    assert torch.allclose(a, expect, atol=1e-6)


def test_a_checkpoint_counts_only_once_every_part_is_written(toy_model, world1, tmp_path):
    """Rewriting ``checkpoint/`` in place (every run's end) first takes its completion marker
    away: a save that dies part-way (here: the critic's part raises) leaves a directory that
    ``newest_checkpoint`` skips instead of one whose stale marker vouches for torn contents."""
    from distflow.launch.checkpoint import STATE_FILE, newest_checkpoint
    from distflow.trainer.actor import Actor
    from distflow.trainer.stages import TrainerContext, save_checkpoint

    import shutil

    model = tmp_path / "model"  # a model whose generation config is its own (stop ids, sampling defaults)
    shutil.copytree(toy_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 3], "temperature": 0.7,
                                                             "do_sample": True}))
    actor = Actor(_cfg(model), with_reference=False)
    out = tmp_path / "run" / "checkpoint"
    out.mkdir(parents=True)
    (out / STATE_FILE).write_text(json.dumps({"policy_version": 99}))  # a previous run's complete save

    class FailingCritic:
        def save_checkpoint(self, _dir):
            raise OSError("disk full")

    state = actor.full_state_dict()
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(TrainerContext(actor.cfg, actor=actor, critic=FailingCritic(), rank=0), out, state, {"step": 0})
    assert not (out / STATE_FILE).exists() and newest_checkpoint(tmp_path / "run") is None
    save_checkpoint(TrainerContext(actor.cfg, actor=actor, critic=None, rank=0), out, state, {"step": 0})
    assert json.loads((out / STATE_FILE).read_text()) == {"policy_version": 0, "step": 0}
    assert newest_checkpoint(tmp_path / "run") == out and not list(out.glob("*.tmp"))
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [1, 3] and saved["temperature"] == 0.7  # the model's, not one made from config.json


def test_checkpoint_drops_the_policys_full_state_before_the_critic_gathers(toy_model, world1, tmp_path):
    """Rank 0 holds one full fp32 model at a time while checkpointing: the policy's gathered
    state is gone when the critic gathers its own (with both, ~57 GB of host memory at 7B)."""
    import gc
    import weakref

    from distflow.launch.checkpoint import STATE_FILE
    from distflow.trainer.actor import Actor
    from distflow.trainer.stages import TrainerContext, save_checkpoint

    actor = Actor(_cfg(toy_model), with_reference=False)
    refs: list = []
    gather = actor.full_state_dict

    def recorded():
        state = gather()
        refs.extend(weakref.ref(t) for t in state.values())
        return state

    actor.full_state_dict = recorded
    alive: list[int] = []

    class Critic:
        def save_checkpoint(self, _dir):
            gc.collect()
            alive.append(sum(r() is not None for r in refs))

    save_checkpoint(TrainerContext(actor.cfg, actor=actor, critic=Critic(), rank=0), tmp_path / "ckpt", None,
                    {"step": 1})
    assert refs and alive == [0]
    assert json.loads((tmp_path / "ckpt" / STATE_FILE).read_text())["step"] == 1


def test_resume_takes_adam_settings_from_the_config_not_the_checkpoint(toy_model):
    from distflow.trainer.actor import apply_optimizer_config

    p = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([p], lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    p.grad = torch.ones(3)
    saved.step()
    resumed = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    resumed.load_state_dict(saved.state_dict())  # what set_optimizer_state_dict does to the groups
    assert resumed.param_groups[0]["weight_decay"] == 0.1
    apply_optimizer_config(resumed, _cfg(toy_model, "weight_decay=0.01", "adam_betas=[0.9,0.95]"))
    assert resumed.param_groups[0]["weight_decay"] == 0.01 and resumed.param_groups[0]["betas"] == (0.9, 0.95)
    assert resumed.state[p]["exp_avg"].abs().sum() > 0  # the moments themselves are kept
    assert resumed.param_groups[0]["lr"] == 1e-3  # the actor's lr is set every step: left alone here
    apply_optimizer_config(resumed, _cfg(toy_model), lr=5e-4)  # the critic's constant lr is restored
    assert resumed.param_groups[0]["lr"] == 5e-4
