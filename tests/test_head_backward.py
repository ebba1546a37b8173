"""The LM head's backward matmuls: on CUDA in the compute dtype (tensor cores) with the
weight gradient accumulated in fp32; on CPU and for fp32 weights exactly the fp32 product."""

from __future__ import annotations

import pytest
import torch

from distflow.trainer import head
from distflow.trainer.head import _add_mm_fp32, chunked_logprobs


def test_cpu_half_inputs_take_the_fp32_product_and_accumulate_in_place():
    g = torch.Generator().manual_seed(0)
    a1, a2 = (torch.randn(40, 7, generator=g).to(torch.bfloat16) for _ in range(2))
    b1, b2 = (torch.randn(7, 12, generator=g).to(torch.bfloat16) for _ in range(2))
    acc = _add_mm_fp32(None, a1, b1)
    assert acc.dtype == torch.float32 and torch.equal(acc, torch.zeros(40, 12).addmm_(a1.float(), b1.float()))
    same = _add_mm_fp32(acc, a2, b2)
    assert same is acc
    assert torch.equal(acc, torch.zeros(40, 12).addmm_(a1.float(), b1.float()).addmm_(a2.float(), b2.float()))


def test_an_optional_kernel_is_tried_once_and_a_later_failure_is_real():
    def refuse():
        raise NotImplementedError("no kernel for this backend")

    works: list[bool | None] = [None]
    assert head._optional_kernel(works, refuse, "k", "fallback") is None and works == [False]
    assert head._optional_kernel(works, lambda: 1, "k", "fallback") is None  # not tried again
    works = [None]
    assert head._optional_kernel(works, lambda: 5, "k", "fallback") == 5 and works == [True]
    with pytest.raises(NotImplementedError):  # it worked before: not a missing kernel
        head._optional_kernel(works, refuse, "k", "fallback")


def test_no_tokens_gives_zero_weight_gradient():
    w = torch.randn(9, 4, requires_grad=True)
    lp, ent = chunked_logprobs(torch.zeros(0, 4, requires_grad=True), w, torch.zeros(0, dtype=torch.int64))
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros(9, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_backward_uses_fp32_output_gemm_and_matches_fp32(dtype):
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 300, 64, 1000
    h32 = torch.randn(n, hdim, generator=g) * 0.5
    w32 = torch.randn(vocab, hdim, generator=g) * 0.1
    t = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    grads = []
    for dt in (torch.float32, dtype):
        h = h32.cuda().to(dt).requires_grad_()
        w = w32.cuda().to(dt).requires_grad_()
        lp, ent = chunked_logprobs(h, w, t.cuda(), 0.9, chunk_tokens=128)  # 3 chunks: accumulation
        (lp * coef.cuda() + 0.1 * ent).sum().backward()
        assert h.grad.dtype == w.grad.dtype == dt
        grads.append((h.grad.float(), w.grad.float()))
    assert head._MM_FP32_OUT[0] is True  # the tensor-core path ran
    assert head._ADDMM_FP32_INTO[0] is not None  # later chunks tried accumulating in place (either way it matches)
    (gh32, gw32), (gh, gw) = grads
    for ref, got in ((gh32, gh), (gw32, gw)):
        assert (got - ref).norm() / ref.norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_half_chunks_accumulate_into_the_fp32_gradient_in_place():
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(64, 48, generator=g).cuda().to(torch.bfloat16) for _ in range(3)]
    b = [torch.randn(48, 80, generator=g).cuda().to(torch.bfloat16) for _ in range(3)]
    acc = _add_mm_fp32(None, a[0], b[0])
    assert acc.dtype == torch.float32
    for x, y in zip(a[1:], b[1:]):
        assert _add_mm_fp32(acc, x, y) is acc
    ref = sum(x.float() @ y.float() for x, y in zip(a, b))
    assert torch.allclose(acc, ref, rtol=1e-3, atol=1e-2)  # bf16 products, fp32 accumulation
