"""Tests of the float64 oracles (vllm_bole.testing.oracles).

1. Tree consistency: every node of a tree equals the oracle re-run on the explicit chain of its
   root-to-node path (all paths batched as one chain batch).
2. Chain cross-checks against third-party code: transformers' Qwen3-Next torch GDN functions and
   whole Qwen3NextGatedDeltaNet layer, FLA's fused_recurrent_gated_delta_rule (TRITON_INTERPRET=1
   only), transformers' Mamba2 torch chunk scan and whole Mamba2Mixer, F.conv1d.
3. Attention against torch SDPA with an independently built mask.

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

from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.oracles import (
    TREE_KINDS,
    attention_tree_reference,
    chain_tree,
    conv_tree_reference,
    gdn_gating,
    gdn_tree_reference,
    make_tree_shape,
    random_tree,
    random_tree_batch,
    ssd_tree_reference,
    tree_shapes,
)

F64 = torch.float64
# transformers' and FLA's GDN / SSD paths compute in float32, whatever the input dtype.
F32_TOL = dict(rtol=1e-4, atol=2e-5)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, scale=1.0, dtype=F64):
    return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype)


# ------------------------------------------------------------------------------ tree helpers
def _path_chains(tree: TreeBatch):
    """(chain batch with one request per node = its root-to-node path, flat gather index,
    request of each chain, flat index of each chain's last node)."""
    depth = tree.depth.long()
    chains = random_tree_batch((depth + 1).tolist(), kind="chain")
    pf = tree.path_flat
    gather = torch.cat([pf[i, : depth[i] + 1] for i in range(tree.num_nodes)])
    last = chains.cu_nodes[1:].long() - 1
    return chains, gather, tree.request_index, last


def test_random_tree_kinds():
    gen = _gen(0)
    for kind in TREE_KINDS:
        for n in (1, 2, 17, 64):
            par = random_tree(n, kind=kind, generator=gen)
            assert len(par) == n and par[0] == -1 and all(0 <= par[i] < i for i in range(1, n))
            depth = TreeBatch.from_parents([par]).depth
            if kind == "chain":
                assert par == list(range(-1, n - 1))
            if kind == "star":
                assert int(depth.max()) == min(n - 1, 1)
            if kind == "wide":
                assert int(depth.max()) <= 2
            if kind == "deep":
                assert int(depth.max()) >= n // 2
    par = random_tree(60, max_depth=5, kind="deep", generator=gen)
    assert int(TreeBatch.from_parents([par]).depth.max()) == 5
    with pytest.raises(ValueError):
        random_tree(5, max_depth=2, kind="chain")
    # Deterministic for a seed; sibling tokens distinct.
    a = random_tree_batch([30, 1, 9], generator=_gen(3), token_vocab=40)
    b = random_tree_batch([30, 1, 9], generator=_gen(3), token_vocab=40)
    assert torch.equal(a.parent, b.parent) and torch.equal(a.token_ids, b.token_ids)
    kids = [(p, t) for p, t in zip(a.parent_flat.tolist(), a.token_ids.tolist()) if p >= 0]
    assert len(set(kids)) == len(kids) and len(kids) == a.num_nodes - a.num_requests
    for name in tree_shapes():
        t = make_tree_shape(name, seed=1)
        assert t.num_nodes == sum(t.nodes_per_request.tolist())
    assert make_tree_shape("deep16").max_depth == 16
    assert 1 in make_tree_shape("ragged").nodes_per_request.tolist()
    c = chain_tree(4, batch=3)
    assert c.num_requests == 3 and c.depth.tolist() == [0, 1, 2, 3] * 3


# ------------------------------------------------------------------------ 1. tree consistency
@pytest.mark.parametrize("shape", tree_shapes())
def test_gdn_tree_matches_path_chains(shape):
    tree = make_tree_shape(shape, seed=11)
    g_ = _gen(1)
    T, B, Hk, Hv, K, V = tree.num_nodes, tree.num_requests, 2, 4, 8, 6
    q, k = _randn(T, Hk, K, gen=g_, dtype=torch.float32), _randn(T, Hk, K, gen=g_)
    v = _randn(T, Hv, V, gen=g_)
    g, beta = gdn_gating(_randn(T, Hv, gen=g_), _randn(T, Hv, gen=g_), _randn(Hv, gen=g_, scale=0.5), _randn(Hv, gen=g_))
    s0 = _randn(B, Hv, K, V, gen=g_)
    o, st = gdn_tree_reference(tree, q, k, v, g, beta, s0)
    assert o.dtype == F64 and st.shape == (T, Hv, K, V)
    chains, idx, req, last = _path_chains(tree)
    oc, sc = gdn_tree_reference(chains, q[idx], k[idx], v[idx], g[idx], beta[idx], s0[req])
    torch.testing.assert_close(o, oc[last], rtol=0, atol=1e-12)
    torch.testing.assert_close(st, sc[last], rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", tree_shapes())
def test_ssd_tree_matches_path_chains(shape):
    tree = make_tree_shape(shape, seed=12)
    g_ = _gen(2)
    T, B, H, G, P, N = tree.num_nodes, tree.num_requests, 4, 2, 5, 3
    x, dt = _randn(T, H, P, gen=g_), _randn(T, H, gen=g_)
    Bm, Cm = _randn(T, G, N, gen=g_), _randn(T, G, N, gen=g_, dtype=torch.bfloat16)
    A, D, dtb = -torch.rand(H, generator=g_, dtype=F64) - 0.1, _randn(H, gen=g_), _randn(H, gen=g_)
    s0 = _randn(B, H, P, N, gen=g_)
    kw = dict(D=D, dt_bias=dtb, dt_limit=(0.1, 1.5))
    y, st = ssd_tree_reference(tree, x, dt, A, Bm, Cm, s0, **kw)
    chains, idx, req, last = _path_chains(tree)
    yc, sc = ssd_tree_reference(chains, x[idx], dt[idx], A, Bm[idx], Cm[idx], s0[req], **kw)
    torch.testing.assert_close(y, yc[last], rtol=0, atol=1e-12)
    torch.testing.assert_close(st, sc[last], rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", tree_shapes())
def test_conv_tree_matches_path_chains(shape):
    tree = make_tree_shape(shape, seed=13)
    g_ = _gen(3)
    T, B, C, W = tree.num_nodes, tree.num_requests, 6, 4
    x, w, bias, cs0 = _randn(T, C, gen=g_), _randn(C, W, gen=g_), _randn(C, gen=g_), _randn(B, C, W - 1, gen=g_)
    y, st = conv_tree_reference(tree, x, w, cs0, bias=bias)
    chains, idx, req, last = _path_chains(tree)
    yc, sc = conv_tree_reference(chains, x[idx], w, cs0[req], bias=bias)
    torch.testing.assert_close(y, yc[last], rtol=0, atol=1e-12)
    torch.testing.assert_close(st, sc[last], rtol=0, atol=1e-12)
    # The conv state of a node is literally the last W-1 inputs along its path (padded by cs0).
    for i in range(T):
        seq = torch.cat([cs0[req[i]], x[idx][chains.cu_nodes[i] : chains.cu_nodes[i + 1]].T], dim=1)
        assert torch.equal(st[i], seq[:, -(W - 1) :])


@pytest.mark.parametrize("shape", tree_shapes())
def test_attention_tree_matches_path_chains(shape):
    tree = make_tree_shape(shape, seed=14)
    g_ = _gen(4)
    T, B, Hq, Hkv, D = tree.num_nodes, tree.num_requests, 4, 2, 8
    q, k, v = _randn(T, Hq, D, gen=g_), _randn(T, Hkv, D, gen=g_), _randn(T, Hkv, D, gen=g_)
    lens = [(3 * r) % 7 for r in range(B)]  # includes 0
    kp = [_randn(L, Hkv, D, gen=g_) for L in lens]
    vp = [_randn(L, Hkv, D, gen=g_) for L in lens]
    o = attention_tree_reference(tree, q, k, v, kp, vp)
    chains, idx, req, last = _path_chains(tree)
    oc = attention_tree_reference(chains, q[idx], k[idx], v[idx], [kp[r] for r in req], [vp[r] for r in req])
    torch.testing.assert_close(o, oc[last], rtol=0, atol=1e-12)


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


# ------------------------------------------------------------------------ 2c. conv vs conv1d
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("W", [2, 4])
def test_conv_vs_torch_conv1d(activation, W):
    """Ragged chain batch (lengths 6, 1, 2, 9; some shorter than W-1) against a causal F.conv1d
    over [committed state, inputs] per request (float64)."""
    g_ = _gen(9)
    sizes, C = [6, 1, 2, 9], 5
    tree = random_tree_batch(sizes, kind="chain")
    x, w, bias = _randn(tree.num_nodes, C, gen=g_), _randn(C, W, gen=g_), _randn(C, gen=g_)
    cs0 = _randn(len(sizes), C, W - 1, gen=g_)
    y, st = conv_tree_reference(tree, x.float(), w, cs0, bias=bias, activation=activation)
    cu = tree.cu_nodes.tolist()
    for r in range(len(sizes)):
        seq = torch.cat([cs0[r], x[cu[r] : cu[r + 1]].float().double().T], dim=1)  # [C, W-1 + n]
        ref = F.conv1d(seq[None], w[:, None, :], bias, groups=C)[0].T  # valid conv = causal with state
        if activation == "silu":
            ref = F.silu(ref)
        torch.testing.assert_close(y[cu[r] : cu[r + 1]], ref, rtol=1e-12, atol=1e-12)
        for t in range(cu[r + 1] - cu[r]):
            assert torch.equal(st[cu[r] + t], seq[:, t + 1 : t + W])


# --------------------------------------------------------------------------- 3. attention
@pytest.mark.parametrize("shape", ["ragged", "deep16", "star"])
def test_attention_vs_sdpa(shape):
    """torch SDPA per request with a dense boolean mask [n, L + n] built by walking parent
    pointers (not from the tree's path/anc_mask), GQA expanded by repeat_interleave."""
    tree = make_tree_shape(shape, seed=21)
    g_ = _gen(10)
    T, B, Hq, Hkv, D = tree.num_nodes, tree.num_requests, 6, 2, 16
    q, k, v = _randn(T, Hq, D, gen=g_), _randn(T, Hkv, D, gen=g_), _randn(T, Hkv, D, gen=g_)
    lens = [0 if r % 2 else 5 + r for r in range(B)]
    kp = [_randn(L, Hkv, D, gen=g_) for L in lens]
    vp = [_randn(L, Hkv, D, gen=g_) for L in lens]
    o = attention_tree_reference(tree, q, k, v, kp, vp, scale=0.3)
    for r in range(B):
        parents, _ = tree.request(r)
        s, n, L = int(tree.cu_nodes[r]), len(parents), lens[r]
        mask = torch.zeros(n, L + n, dtype=torch.bool)
        mask[:, :L] = True
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, L + j] = True
                j = parents[j]
        keys = torch.cat([kp[r], k[s : s + n]]).repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        vals = torch.cat([vp[r], v[s : s + n]]).repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[s : s + n].transpose(0, 1), keys, vals, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(o[s : s + n], ref.transpose(0, 1), rtol=1e-12, atol=1e-12)
    # A root with an empty prefix attends to itself only.
    r0 = [r for r in range(B) if lens[r] == 0]
    if r0:
        s = int(tree.cu_nodes[r0[0]])
        torch.testing.assert_close(o[s], v[s].repeat_interleave(Hq // Hkv, 0), rtol=0, atol=1e-12)
    o_default = attention_tree_reference(tree, q, k, v, kp, vp)
    assert not torch.allclose(o_default, o)  # scale matters (default D ** -0.5)


def test_chi2_homogeneity_detects_a_shift():
    from vllm_bole.testing.stats import chi2_homogeneity_pvalue

    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02])
    q = torch.tensor([0.35, 0.3, 0.25, 0.05, 0.03, 0.02])
    a = torch.bincount(torch.multinomial(p, 4000, True, generator=g), minlength=6)
    b = torch.bincount(torch.multinomial(p, 3000, True, generator=g), minlength=6)
    c = torch.bincount(torch.multinomial(q, 3000, True, generator=g), minlength=6)
    assert chi2_homogeneity_pvalue(a, b) > 1e-3
    assert chi2_homogeneity_pvalue(a, c) < 1e-4
