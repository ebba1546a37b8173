"""LoRA (``model.lora``, docs/lora.md): adapters train over a frozen FSDP2 base, a weight sync sends
only them, the engine applies them exactly, every sync is verified, the checkpoint is PEFT's.

Real components throughout: PEFT's LoRA layers in the FSDP2-sharded policy (a one-rank gloo
group), the real publisher and inbox over a real channel pair, the real TorchEngine, and
``peft.PeftModel.from_pretrained`` reading the checkpoint. The example learns in one real
``distflow run``.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from distflow.core.config import load_config
from distflow.core.config_keys import ConfigError
from distflow.weights.adapter import adapter_checksum, is_adapter
from tests.conftest import ROOT, run_distflow
from tests.process_group import process_group, store_path
from tests.test_packing import make_batch

EXAMPLE = ROOT / "examples" / "grpo_lora_quickstart.yaml"
SECRET = "test-lora-secret-0123456789abcdef0123"


def _cfg(toy_model, *overrides):
    return load_config(EXAMPLE, [f"model_path={toy_model}", "toy_model=false", "micro_batch_size=4",
                                 "grad_clip=1000", "lr=0.01", *overrides])


def test_two_sharded_ranks_train_the_adapters_as_one_rank(tmp_path, toy_model):
    """The injected meta model of rank 1 receives rank 0's base and adapter initialisation, and two
    uneven FSDP2 ranks take the same step as one rank (tests/test_actor.py's harness, with LoRA)."""
    import torch.distributed as dist

    from tests.test_actor import _forked, _two_ranks

    assert not dist.is_initialized()  # first in this file: the forked ranks join groups of their own
    lora = ["lora.rank=4", "lora.target_modules=[q_proj,v_proj,down_proj,lm_head]"]
    two = _two_ranks(tmp_path, toy_model, "two", lora)
    out = str(tmp_path / "one.pt")
    _forked(1, (1, str(tmp_path / "one.store"), str(toy_model), ["kl_coef=0.01", "lr=0.01", *lora], out))
    one = torch.load(out)
    assert set(one["state"]) == set(two["state"]) and all(is_adapter(n) for n in one["state"])
    assert len(one["state"]) == 2 * (3 * 2 + 1)
    for key in ("loss", "pg_loss", "kl", "grad_norm"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    for name, t in one["state"].items():  # (a lora_A did not move: B was 0; every lora_B did)
        assert torch.allclose(t, two["state"][name], atol=1e-5), name


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """This pytest process as a one-rank gloo group (FileStore: no port to race for)."""
    with process_group(store_path(tmp_path_factory.mktemp("pg"))):
        yield


@pytest.fixture(scope="module")
def trained(toy_model, world1):
    """A LoRA policy after one optimizer step, with its parameters before and after the step."""
    from distflow.trainer.actor import Actor

    cfg = _cfg(toy_model)
    actor = Actor(cfg, with_reference=False)
    before = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
    stats = actor.update(cfg.node("ACTOR", "MODEL_TRAIN"), make_batch(8, seed=5))
    after = {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}
    return {"cfg": cfg, "actor": actor, "before": before, "after": after, "stats": stats}


def test_one_step_changes_the_adapters_only(trained):
    before, after, actor = trained["before"], trained["after"], trained["actor"]
    adapters = sorted(n for n in before if is_adapter(n))
    # q,k,v,o,gate,up,down of 2 layers and the LM head, an A and a B each
    assert len(adapters) == 2 * (7 * 2 + 1)
    assert sum(len(g["params"]) for g in actor.optim.param_groups) == len(adapters)  # the optimizer holds them only
    base = [n for n in before if not is_adapter(n)]
    assert base and all(torch.equal(before[n], after[n]) for n in base)  # bit for bit
    # B starts at 0 (PEFT), so the first step's gradient of A is 0 and only every B moves
    changed = {n for n in adapters if not torch.equal(before[n], after[n])}
    assert changed == {n for n in adapters if ".lora_B." in n}
    assert all(float(before[n].abs().max()) == 0.0 for n in changed)
    assert trained["stats"]["grad_norm"] > 0


@contextlib.asynccontextmanager
async def _serving(cfg, actor):
    """The trainer's real publish path (``trainer.worker.publishing``) to a WeightInbox over a
    real channel pair: yields (publish, publisher, inbox)."""
    from distflow.trainer.worker import publishing
    from distflow.transport import Endpoint, make_transport
    from distflow.weights import WeightInbox, WeightPublisher

    a, b = make_transport("zmq", "trainer", SECRET), make_transport("zmq", "rollout", SECRET)
    await a.start()
    await b.start()
    inbox = WeightInbox()
    b.set_handler(inbox.receive)
    pub = WeightPublisher(a, ["rollout"], lambda _: Endpoint("rollout", "127.0.0.1", b.port), lambda _: True,
                          timeout=10)
    try:
        yield publishing(cfg, actor, pub, keep=True), pub, inbox
    finally:
        await pub.close()
        await a.close()
        await b.close()


def _engine(toy_model, cfg):
    from distflow.rollout.torch_engine import TorchEngine

    return TorchEngine(str(toy_model), lora=cfg.lora.model_dump(), max_slots=16)


def _completions_batch(engine, n: int = 8):
    """A batch the engine sampled (temperature 1, its logprobs), for the trainer to score."""
    from distflow.buffer.batch import SampleBatch
    from distflow.rollout.protocol import SamplingParams

    prompts = [engine.tokenizer.encode(p) for p in ["3947=", "12=", "5=", "880="] * (n // 4)]
    done = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0), seed=3)
    return SampleBatch.from_lists([f"s{i}" for i in range(n)], [f"p{i}" for i in range(n)], prompts,
                                  [c.tokens for c in done], [c.logprobs for c in done])


def test_sync_sends_only_adapters_and_the_engine_applies_them_exactly(trained, toy_model):
    from distflow.rollout.lora_apply import verify_applied

    cfg, actor = trained["cfg"], trained["actor"]
    engine = _engine(toy_model, cfg)
    before_sync = _completions_batch(engine)

    async def main():
        async with _serving(cfg, actor) as (publish, pub, inbox):
            nbytes = await publish(actor.version)
            await pub.flush(10)
            return nbytes, inbox.take_update(), inbox.taken_bytes, dict(inbox.checksums), dict(publish.checksums)

    nbytes, update, received, checksums, published = asyncio.run(main())
    adapters = {n: p for n, p in actor.model.named_parameters() if is_adapter(n)}
    sent = {n: t for b in update.buckets for n, t in b.items()}
    assert set(sent) == set(adapters) and update.version == actor.version == 1
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters.values())  # fp32 masters: 4 bytes each
    assert nbytes == received == sum(t.numel() * t.element_size() for t in sent.values()) == adapter_bytes
    assert adapter_bytes == 4 * sum(p.numel() for p in adapters.values())
    assert all(torch.equal(sent[n], p.full_tensor()) for n, p in adapters.items())
    assert checksums == published and len(published[1]) == 32

    engine.load_weights(update.version, update.buckets, update.is_delta)
    assert verify_applied(engine, checksums) == (1, published[1])
    batch = _completions_batch(engine)
    old = actor.old_logprobs(batch).tensors["old_logprobs"]  # the trainer's PEFT model, same tokens
    assert torch.allclose(old, batch.tensors["logprobs"], atol=1e-5, rtol=0), (old - batch.tensors["logprobs"]).abs().max()
    # and the sync changed what the engine samples from: the base model's logprobs differ
    base = actor.old_logprobs(before_sync).tensors["old_logprobs"]
    assert (base - before_sync.tensors["logprobs"]).abs().max() > 1e-3
    engine.close()


def test_a_sync_the_engine_did_not_apply_exactly_is_an_error_naming_the_version(trained, toy_model):
    from distflow.rollout.lora_apply import WeightSyncError, verify_applied

    cfg, actor = trained["cfg"], trained["actor"]
    engine = _engine(toy_model, cfg)

    async def main():
        async with _serving(cfg, actor) as (publish, pub, inbox):
            await publish(7)  # a good version, applied
            await pub.flush(10)
            u = inbox.take_update()
            engine.load_weights(u.version, u.buckets, u.is_delta)
            verify_applied(engine, inbox.checksums)
            good = dict(u.buckets[0])
            # a commit whose checksum is not the adapter's (through the real publisher and inbox)
            await pub.publish_iter(8, iter([good]), lambda: {"checksum": "0" * 32})
            await pub.flush(10)
            u = inbox.take_update()
            engine.load_weights(u.version, u.buckets, u.is_delta)
            with pytest.raises(WeightSyncError, match=r"weights v8: the engine applied an adapter with checksum"):
                verify_applied(engine, inbox.checksums)
            # a sync that silently does nothing: v9 (another adapter) arrives, the engine takes its number
            # and no tensor
            moved = {n: t + 1.0 if ".lora_B." in n else t for n, t in good.items()}
            await pub.publish_iter(9, iter([moved]), lambda: {"checksum": adapter_checksum(moved)})
            await pub.flush(10)
            assert inbox.take_update().version == 9
            engine.load_weights(9, [{}], True)
            with pytest.raises(WeightSyncError, match=r"weights v9: .* but the trainer published"):
                verify_applied(engine, inbox.checksums)
            # a commit without a checksum (an older trainer) cannot be verified
            await pub.publish_iter(10, iter([good]))
            await pub.flush(10)
            u = inbox.take_update()
            engine.load_weights(u.version, u.buckets, u.is_delta)
            with pytest.raises(WeightSyncError, match=r"weights v10: the trainer's commit carried no adapter checksum"):
                verify_applied(engine, inbox.checksums)

    asyncio.run(main())
    # a payload with base weights or a wrong rank is refused before anything is applied
    with pytest.raises(ValueError, match=r"version=11.*not an adapter tensor"):
        engine.load_weights(11, {"model.embed_tokens.weight": torch.zeros(17, 64)}, True)
    engine.close()


def test_a_trainer_rank_checks_what_its_rollout_nodes_report_applying():
    from distflow.core.mesh import Member
    from distflow.trainer.worker import check_reported_adapters

    def member(node_id: str, meta: dict) -> Member:
        return Member(node_id, "rollout", "127.0.0.1", 7000, "alive", 1, meta, 100.0, 0.0)

    published = {3: "a" * 32, 4: "b" * 32}  # what this rank published, by version
    members = {"r0": member("r0", {"weights_version": 4, "weights_checksum": "b" * 32}),
               "r1": member("r1", {"weights_version": 2, "weights_checksum": "c" * 32}),  # not this rank's version
               "r2": member("r2", {}),  # nothing applied yet
               "r3": member("r3", {"weights_version": 3, "weights_checksum": "b" * 32})}
    check_reported_adapters(members.get, ["r0", "r1", "r2", "gone"], published)
    with pytest.raises(RuntimeError, match=r"weights v3: rollout node r3 applied an adapter with checksum 'b+'"):
        check_reported_adapters(members.get, ["r0", "r3"], published)


def test_checkpoint_is_a_peft_adapter_directory(trained, toy_model, tmp_path):
    from peft import PeftModel

    from distflow.hf import load_causal_lm
    from distflow.trainer.head import response_forward
    from distflow.trainer.lora import inject_lora, load_adapter
    from distflow.trainer.packing import pad_inputs

    cfg, actor = trained["cfg"], trained["actor"]
    out = tmp_path / "ckpt"
    actor.save_checkpoint(out, actor.full_state_dict())()  # the write itself (a background thread in a run)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(load_causal_lm(str(toy_model), torch.float32), str(out)).eval()
    assert peft_model.peft_config["default"].r == 16
    mine = {n: p.full_tensor() for n, p in actor.model.named_parameters() if is_adapter(n)}
    theirs = {n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if is_adapter(n)}
    assert set(theirs) == set(mine) and all(torch.equal(theirs[n], mine[n]) for n in mine)
    batch = make_batch(8, seed=9)
    inputs = pad_inputs(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"))
    with torch.no_grad():
        logits = peft_model(input_ids=inputs.input_ids).logits.float()  # PEFT's own forward, not ours
    lp = torch.log_softmax(logits, -1)
    expect = torch.cat([lp[i, len(p) - 1:len(p) - 1 + len(r)].gather(-1, r[:, None]).squeeze(-1)
                        for i, (p, r) in enumerate(zip(batch.ragged("prompt_tokens"), batch.ragged("response_tokens")))])
    assert torch.allclose(actor.old_logprobs(batch).tensors["old_logprobs"], expect, atol=1e-5)
    # a run resumes from it: the adapter is loaded into a fresh model, name for name
    fresh = inject_lora(load_causal_lm(str(toy_model), torch.float32), cfg.lora)
    load_adapter(fresh, out)
    with torch.no_grad():
        again, _ = response_forward(fresh, inputs)
    assert torch.allclose(again, expect, atol=1e-5)
    other = load_config(EXAMPLE, [f"model_path={toy_model}", "lora.rank=4"]).lora
    with pytest.raises(ValueError, match=r"resume_from: the adapter in .* does not fit model.lora"):
        load_adapter(inject_lora(load_causal_lm(str(toy_model), torch.float32), other), out)


def test_lora_config_is_validated_naming_the_key(toy_model):
    from distflow.hf import load_causal_lm
    from distflow.trainer.lora import inject_lora

    for override, message in (("lora.rank=0", "model.lora.rank"), ("lora.target_modules=[]", "model.lora.target_modules"),
                              ("lora.dropout=1.5", "model.lora.dropout"), ("lora.rank=x", "model.lora.rank")):
        with pytest.raises(ConfigError, match=message):
            load_config(EXAMPLE, [override])
    with pytest.raises(ConfigError, match=r"lora: the vllm engine cannot apply LoRA"):
        load_config(EXAMPLE, ["engine=vllm", "device=cuda"])
    cfg = load_config(EXAMPLE, [f"model_path={toy_model}", "lora.target_modules=[qproj]"])
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['qproj'\] matches no nn.Linear module.*'q_proj'"):
        inject_lora(load_causal_lm(str(toy_model), torch.float32), cfg.lora)
    from distflow.core.config_explain import explain

    assert explain("lora.rank").splitlines()[:4] == [
        "model.lora.rank  (flat: lora.rank)",
        "  section: model: The policy model (and the critic's starting point), and the dtype everything computes in.",
        "  type:    int (> 0)", "  default: 8"]
    assert load_config(EXAMPLE).lora.model_dump() == {
        "rank": 16, "alpha": 24.0, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]}


@pytest.mark.timeout(240)
def test_lora_example_learns_in_a_real_run(tmp_path, toy_model):
    """The shipped example as shipped (one rollout node, one trainer): last-10 minus first-10 mean
    reward >= 0.3; every sync verified (a mismatch would fail the run); each sync's bytes are the
    adapter's; the checkpoint is the PEFT adapter."""
    from safetensors.torch import load_file

    from distflow.trainer.metrics import read_metrics

    out = tmp_path / "lora"
    r = run_distflow(["run", str(EXAMPLE), "--no-progress", f"output_dir={out}", f"model_path={toy_model}",
                      "toy_model=false"], timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    rewards = [m["reward_mean"] for m in rows]
    assert len(rewards) == 80
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"grpo_lora: first-10 {first:.3f}, last-10 {last:.3f}")
    assert last - first >= 0.3, (first, last)
    adapter = load_file(str(out / "checkpoint" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert {m["weight_sync_bytes"] for m in rows} == {float(adapter_bytes)}
    loads = [m["weight_load_bytes"] for m in rows if "weight_load_bytes" in m]  # what the rollout node took
    assert len(loads) > 40 and set(loads) == {float(adapter_bytes)}
