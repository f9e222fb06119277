"""``sample_logits``: the Triton kernel (interpreter) and its torch twin against a float64 inverse-CDF
reference: greedy rows the argmax (ties: the first), sampled rows the token whose CDF interval holds the
uniform (within fp32 rounding of the interval's ends), masked tokens never."""
import pytest
import torch

from vllm_bole.spec_decode.sampling import SAMPLING_EPS, sample_logits


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor):
    """float64: per row the CDF interval [lo, hi) of every token; greedy rows the argmax."""
    x = logits.double() / temperature.double().clamp(min=SAMPLING_EPS)[:, None]
    cdf = x.softmax(-1).cumsum(-1)
    lo = torch.cat([torch.zeros_like(cdf[:, :1]), cdf[:, :-1]], 1)
    return lo, cdf, logits.double().argmax(-1)


def check(tokens, logits, temperature, u, tol=2e-5):
    lo, hi, argmax = sample_reference(logits, temperature, u)
    greedy = temperature < SAMPLING_EPS
    r = torch.arange(logits.shape[0])
    assert torch.equal(tokens[greedy], argmax[greedy])
    s = ~greedy
    y = u.double()
    assert bool((lo[r, tokens][s] <= y[s] + tol).all() and (y[s] <= hi[r, tokens][s] + tol).all())
    assert bool(torch.isfinite(logits[r, tokens]).all())  # never a masked (zero-probability) token


@pytest.mark.parametrize("V", [7, 5000, 8192 + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_twin_against_the_reference(V, dtype):
    g = torch.Generator().manual_seed(V)
    N = 33
    wide = 3.0 * torch.randn(N, V + 5, generator=g)
    logits = wide[:, 2 : V + 2].to(dtype)  # rows strided
    logits[0, : V // 2] = -float("inf")  # masked tokens
    logits[1, :] = -float("inf")
    logits[1, V // 3] = 0.0  # one token left
    logits[2, : min(V, 4)] = 50.0  # greedy ties: the first
    temperature = torch.rand(N, generator=g) * 1.5 + 0.2
    temperature[2:6] = 0.0
    temperature[6] = SAMPLING_EPS / 2
    u = torch.rand(N, generator=g)
    u[0], u[7] = 1 - 1e-7, 0.0  # the ends of the CDF
    for kernels in ("triton", "torch"):
        tokens = sample_logits(logits, temperature, u, kernels=kernels)
        assert tokens.dtype == torch.int64 and tokens.shape == (N,)
        check(tokens, logits.float(), temperature, u)
    assert int(sample_logits(logits, temperature, u, kernels="triton")[2]) == 0
    assert int(sample_logits(logits, temperature, u, kernels="triton")[1]) == V // 3


def test_kernel_equals_the_twin_away_from_interval_ends():
    """Away from a CDF interval's ends the two pick the same token (only rounding can move it)."""
    g = torch.Generator().manual_seed(0)
    N, V = 64, 3000
    logits = 2.0 * torch.randn(N, V, generator=g)
    temperature = torch.full((N,), 0.9)
    u = torch.rand(N, generator=g)
    lo, hi, _ = sample_reference(logits, temperature, u)
    a = sample_logits(logits, temperature, u, kernels="triton")
    b = sample_logits(logits, temperature, u, kernels="torch")
    r = torch.arange(N)
    clear = (u.double() - lo[r, b] > 1e-4) & (hi[r, b] - u.double() > 1e-4)
    assert int(clear.sum()) > N // 2 and torch.equal(a[clear], b[clear])


def test_no_rows():
    out = sample_logits(torch.zeros(0, 9), torch.zeros(0), torch.zeros(0), kernels="triton")
    assert out.shape == (0,) and out.dtype == torch.int64
