"""benchmarks/mamba2_train.py: the pair's Mamba2 training forward against transformers' own (logits and
gradients of a tiny NemotronH, several chunks with padding, one and two groups)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from mamba2_train import chunked_ssd, use_fast_mamba2  # noqa: E402
from train_pair import make_config  # noqa: E402


@pytest.mark.parametrize("t,chunk", [(1, 4), (13, 4), (16, 4), (40, 16)])
def test_chunked_ssd_equals_the_recurrence(t, chunk):
    """Against the float64 recurrence h_t = exp(a_t) h_{t-1} + x_t b_t^T, y_t = h_t c_t (padded last chunk too)."""
    g = torch.Generator().manual_seed(t)
    B, H, P, N = 2, 3, 4, 5
    x, b, c = (torch.randn(B, t, H, k, generator=g, dtype=torch.float64) for k in (P, N, N))
    a = -torch.rand(B, t, H, generator=g, dtype=torch.float64) * 2
    h, want = torch.zeros(B, H, P, N, dtype=torch.float64), []
    for i in range(t):
        h = torch.exp(a[:, i])[..., None, None] * h + x[:, i, :, :, None] * b[:, i, :, None, :]
        want.append(torch.einsum("bhpn,bhn->bhp", h, c[:, i]))
    got = chunked_ssd(x, a, b, c, chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.stack(want, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_fast_mamba2_matches_transformers(groups):
    import transformers

    cfg = make_config("nemotron_h", vocab=97, tiny=True)
    cfg.n_groups, cfg.chunk_size = groups, 32
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
    with torch.no_grad():  # non-trivial decays and skips, and a scan term as large as the skip (x, B, C of order 1)
        for m in ref.modules():
            if hasattr(m, "A_log"):
                m.A_log.uniform_(-1.0, 1.0), m.dt_bias.normal_(), m.D.normal_()
                m.in_proj.weight.normal_(0.0, m.in_proj.in_features ** -0.5), m.conv1d.weight.normal_(0.0, 0.5)
    fast = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
    fast.load_state_dict(ref.state_dict())
    assert use_fast_mamba2(fast) == sum(t == "linear_attention" for t in cfg.layers_block_type)
    x = torch.randint(0, 97, (2, 77), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (ref, fast):
        logits = model(input_ids=x, use_cache=False).logits
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    for name, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], g, rtol=1e-3, atol=1e-6, msg=name)


def test_fast_mamba2_refuses_a_cache():
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(make_config("nemotron_h", vocab=97, tiny=True))
    use_fast_mamba2(model)
    mixer = next(m for m in model.modules() if hasattr(m, "A_log"))
    with pytest.raises(ValueError, match="cache_params"):
        mixer(torch.zeros(1, 3, model.config.hidden_size), cache_params=object())
