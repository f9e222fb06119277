"""The draft's top-k with softmax probabilities (``vllm_bole.spec_decode.vocab_topk``): the Triton kernel
(under the interpreter) and the torch twin against the float64 reference."""
import pytest
import torch

from vllm_bole.spec_decode.vocab_topk import vocab_topk, vocab_topk_reference, vocab_topk_torch


def logits_of(T, V, dtype, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g, dtype=torch.float64) * 3
    if ties:  # a few values repeated at the top, across chunks: the lower id first
        x[:, V // 2] = x[:, 1] = x[:, -1] = x.max() + 1
    return x.to(dtype)


@pytest.mark.parametrize("T,V,k", [(1, 7, 1), (3, 1000, 8), (2, 4096, 16), (5, 4097, 8), (2, 49152, 8),
                                   (33, 300, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference(T, V, k, dtype):
    x = logits_of(T, V, dtype, seed=T * V + k, ties=V > 8)
    p, t = vocab_topk(x, k, kernels="triton")
    rp, rt = vocab_topk_reference(x, k)
    assert t.dtype == torch.int64 and p.dtype == torch.float32 and p.shape == t.shape == (T, k)
    assert torch.equal(t, rt)  # ties (bf16 has many) to the lower id, as the reference
    torch.testing.assert_close(p.double(), rp, rtol=2e-6, atol=1e-9)


def test_kernel_reads_strided_rows_and_masked_vocabularies():
    base = logits_of(4, 3000, torch.float32, seed=1)
    x = base[:, :2500]  # rows at a stride of 3000
    x[0, :2000] = float("-inf")  # a vocabulary mostly masked
    p, t = vocab_topk(x, 8, kernels="triton")
    rp, rt = vocab_topk_reference(x, 8)
    assert torch.equal(t, rt)
    torch.testing.assert_close(p.double(), rp, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_equals_the_reference(dtype):
    x = logits_of(6, 5000, dtype, seed=3)
    p, t = vocab_topk_torch(x, 8)
    rp, rt = vocab_topk_reference(x, 8)
    # the same values in the same order (torch's top-k may pick other ids among equal values: bf16 has many)
    assert torch.equal(x.gather(1, t), x.gather(1, rt))
    if dtype == torch.float32:
        assert torch.equal(t, rt)
    torch.testing.assert_close(p.double(), rp, rtol=2e-6, atol=1e-9)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="k:"):
        vocab_topk(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="k:"):
        vocab_topk(torch.zeros(2, 5), 0)
    with pytest.raises(ValueError, match="logits:"):
        vocab_topk(torch.zeros(5), 1)
    with pytest.raises(ValueError, match="kernels"):
        vocab_topk(torch.zeros(2, 5), 1, kernels="cuda")
