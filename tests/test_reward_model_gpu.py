"""The learned reward model's GPU-facing knobs, checked on CPU: the forward runs with the
model's device as the thread's current device (distflow.device.on_device), args.dtype and
args.micro_batch_size change how it runs but not what it returns (fp32 on the cpu, ready for
the data plane), and a bad value is refused naming the node and the key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distflow.rl import reward_model as rmod


@pytest.fixture
def rm_dir(reward_model_dir) -> str:
    return str(reward_model_dir)  # the shared tiny reward model (conftest)


class Batch:
    def __init__(self, prompts, responses):
        self.prompts, self.responses, self.tensors = prompts, responses, {}

    def ragged(self, key):
        return self.prompts if key == "prompt_tokens" else self.responses

    def set_scalar(self, key, value):
        self.tensors[key] = value


def make_batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 17, (n,), generator=g) for n in (3, 5, 2, 4, 6)]
    responses = [torch.randint(0, 17, (n,), generator=g) for n in (4, 1, 7, 2, 3)]
    return Batch(prompts, responses)


def node(**args):
    return SimpleNamespace(id="rm", args=args)


def test_micro_batch_size_does_not_change_the_scores_and_they_come_back_fp32_on_cpu(rm_dir):
    one = rmod.score_batch(node(path=rm_dir), make_batch()).tensors["reward"]
    two = rmod.score_batch(node(path=rm_dir, micro_batch_size=2), make_batch()).tensors["reward"]
    assert one.device.type == "cpu" and one.dtype == torch.float32 and one.shape == (5,)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=1e-5)


def test_dtype_arg_loads_the_model_in_that_dtype(rm_dir):
    out = rmod.score_batch(node(path=rm_dir, dtype="bfloat16", micro_batch_size=3), make_batch()).tensors["reward"]
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    rm = rmod.load_reward_model(rm_dir, "cpu", torch.bfloat16)
    assert next(rm.model.parameters()).dtype == torch.bfloat16
    ref = rmod.score_batch(node(path=rm_dir), make_batch()).tensors["reward"]
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)


def test_the_forward_runs_on_the_models_device(rm_dir, monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, device):
            seen.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(rmod, "on_device", Recorder)
    rm = rmod.load_reward_model(rm_dir)
    rm.score(make_batch().prompts, make_batch().responses)
    assert seen == [rm.device]


@pytest.mark.parametrize("args, message", [
    (dict(dtype="fp8"), r"workflow node 'rm': args.dtype 'fp8' must be one of float32, bfloat16, float16"),
    (dict(micro_batch_size=0), r"workflow node 'rm': args.micro_batch_size 0 must be an integer >= 1"),
    (dict(micro_batch_size=True), r"args.micro_batch_size True must be an integer >= 1"),
])
def test_bad_args_are_refused_naming_the_key(rm_dir, args, message):
    with pytest.raises(ValueError, match=message):
        rmod.score_batch(node(path=rm_dir, **args), make_batch())


def test_the_score_head_runs_in_fp32_for_a_half_precision_model(rm_dir):
    rm = rmod.load_reward_model(rm_dir, "cpu", torch.bfloat16)
    h = torch.randn(4, rm.head.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = rm._head_fp32(h)
    assert got.dtype == torch.float32
    assert torch.equal(got, h.float() @ rm.head.weight.float().t())  # not rounded to bf16 (~3 significant digits)
    assert not torch.equal(got, rm.head(h).float())


def test_a_reward_model_with_another_tokenizer_is_refused(tmp_path, toy_model):
    """It reads the policy's token ids: a tokenizer of its own where a policy token is missing or
    has another id is an error; the same tokenizer, one that only adds tokens, or none, passes."""
    from transformers import AutoTokenizer

    same, other, none = tmp_path / "same", tmp_path / "other", tmp_path / "none"
    for d in (same, other, none):
        d.mkdir()
        (d / "config.json").write_text((toy_model / "config.json").read_text())
    AutoTokenizer.from_pretrained(str(toy_model)).save_pretrained(str(same))
    tok = AutoTokenizer.from_pretrained(str(toy_model))
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(other))
    rmod.same_tokenizer(same, toy_model)
    rmod.same_tokenizer(none, toy_model)
    rmod.same_tokenizer(other, toy_model)  # a token of its own (a fine-tune's pad token) is fine
    with pytest.raises(ValueError, match=r"its tokenizer is not the policy's \(1 of the policy's \d+ tokens are "
                                         r"missing or have another id there\)"):
        rmod.same_tokenizer(same, other)  # a policy token the reward model does not have
