"""The LM head's backward matmuls: on CUDA in the compute dtype (tensor cores) with the
weight gradient accumulated in fp32; on CPU and for fp32 weights exactly the fp32 product."""

from __future__ import annotations

import math

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


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every fp32 tensor an op returns whose storage is new (not one of its inputs': an
    in-place op or a view writes into memory that already existed): (op, shape)."""

    def __init__(self):
        super().__init__()
        self.fresh: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.untyped_storage().data_ptr() not in known:
                self.fresh.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_makes_no_fp32_vocab_by_hidden_temporary_per_chunk(dtype):
    """The weight gradient of 5 chunks: equal to plain autograd on the full logits, and the only
    fp32 [V, H] tensor backward creates is the one accumulator (no product per chunk), recorded
    by a dispatch mode that sees every op's outputs."""
    g = torch.Generator().manual_seed(3)
    n, hdim, vocab = 50, 16, 97
    h32, w32 = torch.randn(n, hdim, generator=g), torch.randn(vocab, hdim, generator=g) * 0.3
    t, coef = torch.randint(0, vocab, (n,), generator=g), torch.randn(n, generator=g)
    h, w = h32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
    lp, ent = chunked_logprobs(h, w, t, 0.7, chunk_tokens=10)
    rec = _Allocations()
    with rec:
        (lp * coef + 0.1 * ent).sum().backward()
    full = [s for _, s in rec.fresh if s == (vocab, hdim)]
    assert len(full) == 1, rec.fresh  # the accumulator; a product per chunk would add 5
    assert max(math.prod(s) for _, s in rec.fresh if s != (vocab, hdim)) <= 10 * vocab  # chunk-sized at most
    hr, wr = h32.detach().clone().requires_grad_(), w32.detach().clone().requires_grad_()
    logp = torch.log_softmax(hr.to(dtype).float() @ wr.to(dtype).float().t() / 0.7, -1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (logp.gather(-1, t[:, None])[:, 0] * coef + 0.1 * ref_ent).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(w.grad.float(), wr.grad, atol=tol * wr.grad.abs().max().item(), rtol=0)
    assert torch.allclose(h.grad.float(), hr.grad, atol=tol * hr.grad.abs().max().item(), rtol=0)


def test_the_cuda_product_is_added_in_row_blocks():
    """The CUDA half path's blocking, with the fp32-result GEMM replaced by its CPU equivalent:
    the product is never computed for more than ``block_bytes`` of rows at once, and the sum is
    the whole product's."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(1000, 6, generator=g).to(torch.bfloat16), torch.randn(6, 32, generator=g).to(torch.bfloat16)
    acc = torch.ones(1000, 32)
    shapes: list[tuple[int, ...]] = []

    def product(x, y):
        shapes.append(tuple(x.shape))
        return x.float() @ y.float()

    out = head._add_rows(acc, a, b, product, block_bytes=128 * 32 * 4)
    assert out is acc and shapes == [(128, 6)] * 7 + [(104, 6)]
    assert torch.allclose(acc, 1 + a.float() @ b.float(), atol=1e-5)
