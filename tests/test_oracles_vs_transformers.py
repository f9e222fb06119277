"""The float64 GDN and SSD oracles against third-party code, on chains: transformers' Qwen3-Next
torch GDN functions and whole Qwen3NextGatedDeltaNet layer, FLA's fused_recurrent_gated_delta_rule
(TRITON_INTERPRET=1 only), transformers' Mamba2 torch chunk scan and whole Mamba2Mixer (moved
from tests/test_oracles.py, unchanged).

transformers binds its GDN / Mamba2 functions to FLA or mamba_ssm at import when those import
(FLA does, even on CPU). We never hide packages: we take the plain torch functions with
``inspect.unwrap`` (the hub decorator keeps them as ``__wrapped__``) and, for whole-layer tests,
monkeypatch the module globals the layer's forward looks up (undone after each test).
"""
from __future__ import annotations

import importlib
import inspect
import os

import pytest
import torch
import torch.nn.functional as F

from vllm_bole.testing.oracles import (
    chain_tree,
    conv_tree_reference,
    gdn_gating,
    gdn_tree_reference,
    random_tree_batch,
    ssd_tree_reference,
)

F64 = torch.float64
# transformers' and FLA's GDN / SSD paths compute in float32, whatever the input dtype.
F32_TOL = dict(rtol=1e-4, atol=2e-5)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, scale=1.0, dtype=F64):
    return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype)


# ------------------------------------------------------------- 2a. GDN vs transformers and FLA
@pytest.fixture(scope="module")
def qwen3_next():
    return importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")


def _gdn_chain_inputs(n, B, Hk, Hv, K, V, seed):
    g_ = _gen(seed)
    q, k = _randn(B, n, Hk, K, gen=g_), _randn(B, n, Hk, K, gen=g_)
    v = _randn(B, n, Hv, V, gen=g_)
    a, b = _randn(B, n, Hv, gen=g_), _randn(B, n, Hv, gen=g_)
    A_log, dt_bias = torch.log(torch.rand(Hv, generator=g_, dtype=F64) + 0.1), _randn(Hv, gen=g_)
    s0 = _randn(B, Hv, K, V, gen=g_, scale=0.5)
    return q, k, v, a, b, A_log, dt_bias, s0


def _flat(x):  # [B, n, ...] -> [B * n, ...]
    return x.reshape(-1, *x.shape[2:])


@pytest.mark.parametrize("which", ["recurrent", "chunk"])
def test_gdn_vs_transformers_torch_functions(qwen3_next, which):
    n, B, Hk, Hv, K, V = 11, 2, 2, 4, 16, 8
    q, k, v, a, b, A_log, dt_bias, s0 = _gdn_chain_inputs(n, B, Hk, Hv, K, V, seed=5)
    g, beta = gdn_gating(_flat(a), _flat(b), A_log, dt_bias)
    o, st = gdn_tree_reference(chain_tree(n, B), _flat(q), _flat(k), _flat(v), g, beta, s0)
    fn = inspect.unwrap(getattr(qwen3_next, f"torch_{which}_gated_delta_rule"))
    extra = {"chunk_size": 4} if which == "chunk" else {}  # several chunks plus padding
    rep = Hv // Hk  # transformers' layer repeat-interleaves q/k to the value heads before calling
    f32 = lambda t: t.float()  # noqa: E731
    ot, ht = fn(
        f32(q.repeat_interleave(rep, 2)), f32(k.repeat_interleave(rep, 2)), f32(v),
        g=f32(g.view(B, n, Hv)), beta=f32(beta.view(B, n, Hv)), initial_state=f32(s0),
        output_final_state=True, use_qk_l2norm_in_kernel=True, **extra,
    )
    torch.testing.assert_close(_flat(ot).double(), o, **F32_TOL)
    torch.testing.assert_close(ht.double(), st.view(B, n, Hv, K, V)[:, -1], **F32_TOL)
    # Able to fail: without the L2 norm the oracle is far from transformers.
    o2, _ = gdn_tree_reference(chain_tree(n, B), _flat(q), _flat(k), _flat(v), g, beta, s0, use_qk_l2norm=False)
    assert (o2 - _flat(ot).double()).abs().max() > 1e-2


def _qwen3_next_layer(qwen3_next, monkeypatch):
    from transformers import Qwen3NextConfig

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        monkeypatch.setattr(qwen3_next, name, inspect.unwrap(getattr(qwen3_next, name)))
    cfg = Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, intermediate_size=32, num_experts=0,
    )
    torch.manual_seed(0)
    layer = qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        layer.A_log.copy_(torch.log(torch.rand(4) + 0.1))
        layer.dt_bias.copy_(torch.randn(4))
        layer.conv1d.weight.mul_(3.0)
    return cfg, layer


def test_gdn_vs_transformers_qwen3_next_layer(qwen3_next, monkeypatch):
    """Whole Qwen3NextGatedDeltaNet with a committed (random) conv + recurrent state in its cache:
    a multi-token call (conv over cache+tokens, chunked rule) then a one-token call (conv update,
    recurrent rule). Compared: the core attention output (the input of the gated RMSNorm, caught
    by a hook) and the cached states, against conv_tree_reference -> gdn_gating ->
    gdn_tree_reference on one chain fed with the layer's own projections (in_proj_qkvz/in_proj_ba)."""
    from transformers import DynamicCache

    cfg, layer = _qwen3_next_layer(qwen3_next, monkeypatch)
    Hk, Hv, K, V, W = 2, 4, 16, 8, 4
    n, hid = 9, torch.randn(1, 12, 32)
    cache = DynamicCache(config=cfg)
    caught = []
    layer.norm.register_forward_pre_hook(lambda mod, args: caught.append(args[0].detach().clone()))
    with torch.no_grad():
        layer(hid[:, :2], cache_params=cache)  # prefill; its state is replaced below
        lc = cache.layers[0]
        lc.conv_states[0].copy_(torch.randn_like(lc.conv_states[0]))
        lc.recurrent_states[0].copy_(0.5 * torch.randn_like(lc.recurrent_states[0]))
        conv0, s0 = lc.conv_states[0][:, :, 1:].clone(), lc.recurrent_states[0].clone()
        layer(hid[:, 2 : 2 + n], cache_params=cache)  # chunk path
        conv_n, s_n = lc.conv_states[0][:, :, 1:].clone(), lc.recurrent_states[0].clone()
        layer(hid[:, 2 + n : 3 + n], cache_params=cache)  # single-token decode path
        conv_d, s_d = lc.conv_states[0][:, :, 1:].clone(), lc.recurrent_states[0].clone()
        # Oracle on the same tokens, from the layer's own input projections.
        x = hid[0, 2 : 3 + n]
        qq, kk, vv, _z, bb, aa = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x[None]), layer.in_proj_ba(x[None]))
        pre = torch.cat([qq.flatten(2), kk.flatten(2), vv.flatten(2)], dim=-1)[0]  # conv input [n + 1, C]
        tree = chain_tree(n + 1)
        y, conv_st = conv_tree_reference(tree, pre, layer.conv1d.weight.squeeze(1), conv0, activation="silu")
        qo, ko, vo = y.split([Hk * K, Hk * K, Hv * V], dim=-1)
        g, beta = gdn_gating(aa[0], bb[0], layer.A_log, layer.dt_bias)
        o, st = gdn_tree_reference(tree, qo.view(-1, Hk, K), ko.view(-1, Hk, K), vo.view(-1, Hv, V), g, beta, s0)
    got = torch.cat([c.view(-1, Hv, V) for c in caught[1:]]).double()
    torch.testing.assert_close(got, o, **F32_TOL)
    torch.testing.assert_close(s_n.double()[0], st[n - 1], **F32_TOL)
    torch.testing.assert_close(s_d.double()[0], st[n], **F32_TOL)
    torch.testing.assert_close(conv_n.double()[0], conv_st[n - 1], **F32_TOL)
    torch.testing.assert_close(conv_d.double()[0], conv_st[n], **F32_TOL)
    assert o.abs().max() > 0.1 and (st[n] - s0[0].double()).abs().max() > 0.1  # not a vacuous comparison


needs_interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="FLA on CPU needs TRITON_INTERPRET=1 set before triton import"
)


@needs_interpret
@pytest.mark.parametrize("gate_in_kernel", [False, True])
def test_gdn_vs_fla_fused_recurrent(gate_in_kernel):
    """FLA's fused_recurrent_gated_delta_rule, varlen over a ragged chain batch (lengths 5, 1, 12),
    native GVA (Hv = 2 Hk), initial states per sequence. With gate_in_kernel, FLA applies the
    Qwen3-Next gating (A_log, dt_bias, sigmoid beta) itself: this checks gdn_gating."""
    importlib.import_module("fla")
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    sizes, Hk, Hv, K, V = [5, 1, 12], 2, 4, 16, 8
    tree = random_tree_batch(sizes, kind="chain")
    T = tree.num_nodes
    q, k, v, a, b, A_log, dt_bias, s0 = _gdn_chain_inputs(T, 1, Hk, Hv, K, V, seed=6)
    s0 = _randn(len(sizes), Hv, K, V, gen=_gen(7), scale=0.5)
    g, beta = gdn_gating(a[0], b[0], A_log, dt_bias)
    o, st = gdn_tree_reference(tree, q[0], k[0], v[0], g, beta, s0)
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    gates = (
        dict(g=f32(a), beta=f32(b), use_gate_in_kernel=True, A_log=f32(A_log), dt_bias=f32(dt_bias),
             use_beta_sigmoid_in_kernel=True)
        if gate_in_kernel
        else dict(g=f32(g[None]), beta=f32(beta[None]))
    )
    of, hf = fused_recurrent_gated_delta_rule(
        q=f32(q), k=f32(k), v=f32(v), **gates, initial_state=f32(s0), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=tree.cu_nodes.long(),
    )
    torch.testing.assert_close(of[0].double(), o, **F32_TOL)
    torch.testing.assert_close(hf.double(), st[tree.cu_nodes[1:].long() - 1], **F32_TOL)


# -------------------------------------------------------------- 2b. SSD vs transformers Mamba2
@pytest.fixture(scope="module")
def mamba2():
    return importlib.import_module("transformers.models.mamba2.modeling_mamba2")


def test_ssd_vs_transformers_mamba2_chunk_scan(mamba2):
    """transformers' torch mamba2_chunk_scan (the chunked SSD shared by Mamba2 / NemotronH /
    GraniteMoeHybrid / FalconH1): batch 2, n_groups 2, chunk 4 over 10 tokens, D, dt_bias,
    a dt_limit that clamps on both sides, initial states; outputs and final states."""
    fn = inspect.unwrap(mamba2.mamba2_chunk_scan)
    g_ = _gen(8)
    Bsz, n, H, G, P, N = 2, 10, 4, 2, 8, 6
    x, dt = _randn(Bsz, n, H, P, gen=g_), _randn(Bsz, n, H, gen=g_)
    Bm, Cm = _randn(Bsz, n, G, N, gen=g_), _randn(Bsz, n, G, N, gen=g_)
    A, D, dtb = -torch.rand(H, generator=g_, dtype=F64) * 2 - 0.1, _randn(H, gen=g_), _randn(H, gen=g_)
    s0 = _randn(Bsz, H, P, N, gen=g_)
    lim = (0.2, 1.0)
    y, st = ssd_tree_reference(chain_tree(n, Bsz), _flat(x), _flat(dt), A, _flat(Bm), _flat(Cm), s0,
                               D=D, dt_bias=dtb, dt_limit=lim)
    f32 = lambda t: t.float()  # noqa: E731
    yt, ht = fn(f32(x), f32(dt), f32(A), f32(Bm), f32(Cm), chunk_size=4, D=f32(D), dt_bias=f32(dtb),
                initial_states=f32(s0), dt_softplus=True, dt_limit=lim, return_final_states=True)
    torch.testing.assert_close(_flat(yt).double(), y, **F32_TOL)
    torch.testing.assert_close(ht.double(), st.view(Bsz, n, H, P, N)[:, -1], **F32_TOL)
    sp = F.softplus(dt + dtb)
    assert (sp < lim[0]).any() and (sp > lim[1]).any()  # the clamp is exercised on both sides
    y2, _ = ssd_tree_reference(chain_tree(n, Bsz), _flat(x), _flat(dt), A, _flat(Bm), _flat(Cm), s0, D=D, dt_bias=dtb)
    assert (y2 - y).abs().max() > 1e-2  # ... and matters


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.15, 0.5)])
def test_ssd_conv_vs_transformers_mamba2_mixer(mamba2, monkeypatch, limit):
    """Whole Mamba2Mixer (n_groups 2, conv bias, D, config.time_step_limit) with a committed
    random conv + SSM state in its cache: a multi-token call (conv over cache+tokens, chunked scan,
    clamps dt with time_step_limit), then a one-token call (conv update + selective_state_update,
    which never clamps). Compared: the SSM output y = hC + Dx (the input of the gated RMSNorm,
    caught by a hook) and the cached states, against conv_tree_reference -> ssd_tree_reference on
    one chain fed with the mixer's own in_proj output."""
    from transformers import DynamicCache, Mamba2Config

    for name in ("mamba2_chunk_scan", "mamba2_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(mamba2, name, inspect.unwrap(getattr(mamba2, name)))
    H, P, N, G, W = 4, 8, 6, 2, 4
    cfg = Mamba2Config(num_heads=H, head_dim=P, hidden_size=16, expand=2, state_size=N, n_groups=G, conv_kernel=W,
                       num_hidden_layers=1, chunk_size=4, time_step_limit=limit, vocab_size=32, use_conv_bias=True)
    torch.manual_seed(1)
    mix = mamba2.Mamba2Mixer(cfg, 0).eval()
    with torch.no_grad():
        mix.dt_bias.copy_(torch.randn(H) - 1.0)
        mix.D.copy_(torch.randn(H))
        mix.A_log.copy_(torch.randn(H) * 0.5)
        mix.conv1d.bias.copy_(torch.randn_like(mix.conv1d.bias))
    n, hid = 9, torch.randn(1, 12, 16)
    cache = DynamicCache(config=cfg)
    caught = []
    mix.norm.register_forward_pre_hook(lambda mod, args: caught.append(args[0].detach().clone()))
    with torch.no_grad():
        mix(hid[:, :2], cache_params=cache)
        lc = cache.layers[0]
        lc.conv_states[0].copy_(torch.randn_like(lc.conv_states[0]))
        lc.recurrent_states[0].copy_(torch.randn_like(lc.recurrent_states[0]))
        conv0, s0 = lc.conv_states[0][:, :, 1:].clone(), lc.recurrent_states[0].clone()
        mix(hid[:, 2 : 2 + n], cache_params=cache)
        conv_n, s_n = lc.conv_states[0][:, :, 1:].clone(), lc.recurrent_states[0].clone()
        mix(hid[:, 2 + n : 3 + n], cache_params=cache)
        conv_d, s_d = lc.conv_states[0][:, :, 1:].clone(), lc.recurrent_states[0].clone()
        _gate, xbc, dt = mix.in_proj(hid[0, 2 : 3 + n]).split([H * P, mix.conv_dim, H], dim=-1)
        A = -torch.exp(mix.A_log.double())
        yc, conv_st = conv_tree_reference(chain_tree(n + 1), xbc, mix.conv1d.weight.squeeze(1), conv0,
                                          bias=mix.conv1d.bias, activation="silu")
        xs, Bm, Cm = yc.split([H * P, G * N, G * N], dim=-1)
        args = (xs.view(-1, H, P), dt, A, Bm.view(-1, G, N), Cm.view(-1, G, N))
        kw = dict(D=mix.D, dt_bias=mix.dt_bias)
        y, st = ssd_tree_reference(chain_tree(n), *(t[:n] for t in args[:2]), A, *(t[:n] for t in args[3:]), s0,
                                   dt_limit=limit, **kw)
        # The decode token: transformers' selective_state_update does not clamp dt.
        y1, st1 = ssd_tree_reference(chain_tree(1), *(t[n:] for t in args[:2]), A, *(t[n:] for t in args[3:]),
                                     st[-1:], **kw)
    torch.testing.assert_close(caught[1].view(n, H, P).double(), y, **F32_TOL)
    torch.testing.assert_close(caught[2].view(1, H, P).double(), y1, **F32_TOL)
    torch.testing.assert_close(s_n.double()[0], st[-1], **F32_TOL)
    torch.testing.assert_close(s_d.double()[0], st1[-1], **F32_TOL)
    torch.testing.assert_close(conv_n.double()[0], conv_st[n - 1], **F32_TOL)
    torch.testing.assert_close(conv_d.double()[0], conv_st[n], **F32_TOL)
    if limit[0] > 0:
        sp = F.softplus(dt[:n].double() + mix.dt_bias.double())
        assert (sp < limit[0]).any() and (sp > limit[1]).any()
