"""The paged draft's decoder glue (``vllm_bole.spec_decode.decoder_ops``): each Triton kernel (under the
interpreter) and its torch twin against the float64 reference, fresh outputs, untouched cache rows kept."""
import pytest
import torch

from vllm_bole.spec_decode.decoder_ops import (add_rms_norm, add_rms_norm_reference, rope_write, rope_write_reference,
                                               silu_mul, silu_mul_reference)

# 16-bit: two roundings of 2^-8 each (the GPU rounds to nearest even; the interpreter truncates, up to 2^-7 each)
DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)]


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,N,with_res", [(1, 64, False), (5, 256, True), (3, 200, True)])
def test_add_rms_norm(kernels, dtype, tol, T, N, with_res):
    g = torch.Generator().manual_seed(T * N)
    res = rand(g, T, 2 * N, dtype=dtype)[:, :N] if with_res else None  # strided rows
    h, w = rand(g, T, N, dtype=dtype), rand(g, N, dtype=dtype)
    r, x = add_rms_norm(res, h, w, 1e-6, kernels)
    rr, rx = add_rms_norm_reference(res, h, w, 1e-6)
    assert r.dtype == x.dtype == dtype and r.shape == x.shape == (T, N)
    torch.testing.assert_close(r.double(), rr, rtol=tol, atol=tol)
    torch.testing.assert_close(x.double(), rx, rtol=tol, atol=tol)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 4, 64), (6, 8, 2, 32), (3, 2, 1, 128)])
def test_rope_write(kernels, dtype, tol, T, H, Hkv, D):
    g = torch.Generator().manual_seed(T + H + D)
    pages, page = 5, 4
    qkv = rand(g, T, H + 2 * Hkv, D, dtype=dtype)
    qk, v = qkv[:, : H + Hkv], qkv[:, H + Hkv:]  # views of one projection, as the decoder's
    P = 40
    ang = torch.arange(P)[:, None] / (10000 ** (torch.arange(D // 2) / (D // 2)))[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    positions = torch.randint(0, P, (T, 2), generator=g)[:, 1]  # strided, as the chain steps' rows of [B, steps].T
    slots = torch.randperm(pages * page, generator=g)[: 2 * T : 2]
    kc, vc = torch.full((pages, page, Hkv, D), float("nan"), dtype=dtype), torch.full((pages, page, Hkv, D), 7.0, dtype=dtype)
    want_q, want_k, want_v = rope_write_reference(qk, v, cos, sin, positions, slots, kc, vc, H)
    q = rope_write(qk, v, cos, sin, positions, slots, kc, vc, H, kernels)
    assert q.shape == (T, H, D) and q.dtype == dtype
    torch.testing.assert_close(q.double(), want_q, rtol=tol, atol=tol)
    written = torch.zeros(pages * page, dtype=torch.bool)
    written[slots] = True
    flat = lambda c: c.reshape(pages * page, Hkv, D)  # noqa: E731
    torch.testing.assert_close(flat(kc)[written].double(), flat(want_k)[written], rtol=tol, atol=tol)
    torch.testing.assert_close(flat(vc).double(), flat(want_v), rtol=tol, atol=tol)
    assert flat(kc)[~written].isnan().all()  # other slots untouched


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 768), (4, 3000)])
def test_silu_mul(kernels, dtype, tol, T, N):
    g = torch.Generator().manual_seed(N)
    gu = rand(g, T, 2 * N, dtype=dtype)
    gate, up = gu.split(N, -1)  # strided halves of one projection, as the decoder's
    out = silu_mul(gate, up, kernels)
    assert out.shape == (T, N) and out.dtype == dtype
    torch.testing.assert_close(out.double(), silu_mul_reference(gate, up), rtol=tol, atol=tol)
