"""The chunked, response-only LM head: exact values and gradients, and O(chunk x vocab) memory.

Memory is measured deterministically as the bytes autograd SAVES for backward
(``torch.autograd.graph.saved_tensors_hooks``), which is what stays alive from the forward
to the backward of a micro-batch: the full-logits path keeps fp32 logits for every
position, the chunked head keeps only its inputs and one fp32 number per token.
"""

from __future__ import annotations

import pytest
import torch

from distflow.trainer.head import chunked_logprobs


def _reference(h, w, t, temperature):
    x = (h @ w.t()) / temperature
    ls = x.log_softmax(-1)
    return ls.gather(-1, t[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 8), (0.7, 5), (1.3, 1000)])
def test_chunked_head_values_and_gradients_match_full_softmax(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 37, 16, 50
    h = torch.randn(n, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    lp, ent = chunked_logprobs(h, w, t, temperature, chunk_tokens=chunk)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (n,)
    (lp * a + ent * b).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp_ref, ent_ref = _reference(h, w, t, temperature)
    (lp_ref * a + ent_ref * b).sum().backward()
    # the head computes in fp32 (like the engine): fp32-level agreement with the fp64 reference
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5)
    assert torch.allclose(ent.double(), ent_ref, atol=1e-4)
    assert torch.allclose(gh, h.grad, atol=1e-4) and torch.allclose(gw, w.grad, atol=1e-4)


def test_chunked_head_logprob_only_gradient_and_greedy_temperature():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 4, generator=g, requires_grad=True)
    w = torch.randn(9, 4, generator=g, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3, 4, 8])
    lp, _ = chunked_logprobs(h, w, t, 0.0, chunk_tokens=4)  # temperature 0 = greedy: reported at T=1
    lp.sum().backward()
    lp_ref, _ = _reference(h, w, t, 1.0)
    assert torch.allclose(lp, lp_ref, atol=1e-6)
    gh = torch.autograd.grad(lp_ref.sum(), h)[0]
    assert torch.allclose(h.grad, gh, atol=1e-5)
    # hand-computed: uniform logits (zero hidden) -> logprob -log(V), entropy log(V)
    lp0, ent0 = chunked_logprobs(torch.zeros(2, 4), w.detach(), torch.tensor([1, 2]))
    assert torch.allclose(lp0, torch.full((2,), -torch.log(torch.tensor(9.0)).item()))
    assert torch.allclose(ent0, torch.full((2,), torch.log(torch.tensor(9.0)).item()))


def test_chunked_head_rejects_bad_input():
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"weight \[5, 3\]"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.int64), -1.0)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``fn`` runs."""
    seen: dict[tuple, int] = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_chunked_head_saves_o_chunk_memory_not_o_tokens_x_vocab():
    """A long sequence (2048 tokens, vocab 4096): the full-logits path saves >= one fp32
    [L, V] tensor (32 MiB); the chunked head saves its inputs plus 4 bytes per token."""
    g = torch.Generator().manual_seed(2)
    length, hdim, vocab = 2048, 32, 4096
    hidden = torch.randn(length, hdim, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hdim, generator=g, requires_grad=True) * 0.05
    targets = torch.randint(0, vocab, (length,), generator=g)

    def full():
        logits = (hidden @ weight.t()).float()
        (logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)).sum()

    def chunked():
        lp, _ = chunked_logprobs(hidden, weight, targets, chunk_tokens=128)
        lp.sum()

    full_bytes, chunked_bytes = _saved_bytes(full), _saved_bytes(chunked)
    inputs = (length * hdim + vocab * hdim) * 4 + length * 8
    assert full_bytes >= length * vocab * 4
    # inputs + fp32 log-normaliser and entropy per token: nothing that scales with tokens x vocab
    assert chunked_bytes <= inputs + 2 * length * 4
    assert full_bytes / chunked_bytes > 30


def test_chunked_head_without_entropy_gives_the_same_logprobs():
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(10, 4, generator=g, requires_grad=True), torch.randn(7, 4, generator=g)
    t = torch.randint(0, 7, (10,), generator=g)
    lp, ent = chunked_logprobs(h, w, t, 0.8, chunk_tokens=3)
    lp2, ent2 = chunked_logprobs(h, w, t, 0.8, chunk_tokens=3, with_entropy=False)
    assert torch.equal(lp, lp2) and torch.equal(ent2, torch.zeros(10)) and not ent2.requires_grad
    g1 = torch.autograd.grad(lp.sum(), h)[0]
    assert torch.equal(g1, torch.autograd.grad(lp2.sum(), h)[0])


@pytest.mark.parametrize("mult,cap,temperature", [(0.125, None, 0.7), (1.0, 2.0, 1.0), (3.0, 1.5, 0.6)])
def test_chunked_head_applies_the_models_logit_multiplier_and_soft_cap(mult, cap, temperature):
    """Values and gradients of ``log_softmax(cap * tanh(mult * h @ W.T / cap) / T)`` against autograd in fp64."""
    g = torch.Generator().manual_seed(3)
    n, hdim, vocab = 23, 8, 40
    h = torch.randn(n, hdim, generator=g, dtype=torch.float64, requires_grad=True)
    w = (3 * torch.randn(vocab, hdim, generator=g, dtype=torch.float64)).requires_grad_()  # logits well past the cap
    t = torch.randint(0, vocab, (n,), generator=g)
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    lp, ent = chunked_logprobs(h, w, t, temperature, chunk_tokens=6, transform=(mult, cap))
    (lp * a + ent * b).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    x = (h @ w.t()) * mult
    if cap is not None:
        x = cap * torch.tanh(x / cap)
    ls = (x / temperature).log_softmax(-1)
    lp_ref, ent_ref = ls.gather(-1, t[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    (lp_ref * a + ent_ref * b).sum().backward()
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5)
    assert torch.allclose(ent.double(), ent_ref, atol=1e-4)
    assert torch.allclose(gh, h.grad, atol=1e-4) and torch.allclose(gw, w.grad, atol=1e-4)
    # the transform matters here: without it the logprobs are different numbers
    plain, _ = chunked_logprobs(h.detach(), w.detach(), t, temperature, chunk_tokens=6)
    assert (plain.double() - lp_ref.detach()).abs().max() > 1e-2


def _tiny(kind: str):
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, GraniteConfig, \
        GraniteForCausalLM

    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4)
    torch.manual_seed(0)
    if kind == "granite":
        return GraniteForCausalLM(GraniteConfig(**common, logits_scaling=8.0))
    if kind == "cohere":
        return CohereForCausalLM(CohereConfig(**common, logit_scale=0.25))
    model = Gemma2ForCausalLM(Gemma2Config(**common, head_dim=8, final_logit_softcapping=1.0))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits well past the soft cap
    return model


@pytest.mark.parametrize("kind", ["granite", "cohere", "gemma2"])
def test_response_forward_matches_the_models_own_logits(kind):
    """The trainer's logprobs are of the distribution the model's forward (and so the engine's HF
    path) samples from: Granite's logits_scaling, Cohere's logit_scale, Gemma 2's soft cap."""
    from distflow.hf import logit_transform
    from distflow.trainer.head import response_forward
    from distflow.trainer.logprobs import gather_response, pad_batch, token_logprobs
    from distflow.trainer.packing import pad_inputs

    model = _tiny(kind).eval()
    assert logit_transform(model.config) != (1.0, None)
    prompts, responses = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], [torch.tensor([6, 7, 8]), torch.tensor([9])]
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            lp, _ = response_forward(model, pad_inputs(prompts, responses), temperature)
            ids, attn, resp = pad_batch(prompts, responses, 0)
            ref = gather_response(token_logprobs(model, ids, attn, temperature), resp)
            torch.testing.assert_close(lp, ref.float(), atol=1e-5, rtol=1e-5)


def test_logit_transform_reads_and_checks_the_config():
    from types import SimpleNamespace

    from distflow.hf import logit_transform

    assert logit_transform(SimpleNamespace()) == (1.0, None)
    assert logit_transform(SimpleNamespace(logits_scaling=4, final_logit_softcapping=30.0)) == (0.25, 30.0)
    assert logit_transform(SimpleNamespace(logit_scale=0.0625, final_logit_softcapping=None)) == (0.0625, None)
    with pytest.raises(ValueError, match="logits_scaling=0"):
        logit_transform(SimpleNamespace(logits_scaling=0))
    with pytest.raises(ValueError, match="final_logit_softcapping=-1"):
        logit_transform(SimpleNamespace(final_logit_softcapping=-1))
