"""Tests of the float64 oracles (vllm_bole.testing.oracles).

1. Tree consistency: every node of a tree equals the oracle re-run on the explicit chain of its
   root-to-node path (all paths batched as one chain batch).
2. The conv against F.conv1d (the GDN and SSD cross-checks against transformers and FLA are in
   tests/test_oracles_vs_transformers.py).
3. Attention against torch SDPA with an independently built mask.
"""
from __future__ import annotations

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


def _assert_matches_path_chains(tree: TreeBatch, got, run):
    """Each node's ``got`` (an oracle's outputs on ``tree``) equals the last node of its chain in
    ``run(chains, rows, reqs)``: the oracle on ``_path_chains(tree)``, node inputs gathered at
    ``rows``, per-request ones at ``reqs``. Returns (chains, rows, reqs)."""
    chains, idx, req, last = _path_chains(tree)
    for out, out_chains in zip(got, run(chains, idx, req), strict=True):
        torch.testing.assert_close(out, out_chains[last], rtol=0, atol=1e-12)
    return chains, idx, req


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
    _assert_matches_path_chains(
        tree, (o, st), lambda c, i, r: gdn_tree_reference(c, q[i], k[i], v[i], g[i], beta[i], s0[r]))


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
    _assert_matches_path_chains(
        tree, (y, st), lambda c, i, r: ssd_tree_reference(c, x[i], dt[i], A, Bm[i], Cm[i], s0[r], **kw))


@pytest.mark.parametrize("shape", tree_shapes())
def test_conv_tree_matches_path_chains(shape):
    tree = make_tree_shape(shape, seed=13)
    g_ = _gen(3)
    T, B, C, W = tree.num_nodes, tree.num_requests, 6, 4
    x, w, bias, cs0 = _randn(T, C, gen=g_), _randn(C, W, gen=g_), _randn(C, gen=g_), _randn(B, C, W - 1, gen=g_)
    y, st = conv_tree_reference(tree, x, w, cs0, bias=bias)
    chains, idx, req = _assert_matches_path_chains(
        tree, (y, st), lambda c, i, r: conv_tree_reference(c, x[i], w, cs0[r], bias=bias))
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
    _assert_matches_path_chains(tree, (o,), lambda c, i, r: (
        attention_tree_reference(c, q[i], k[i], v[i], [kp[j] for j in r], [vp[j] for j in r]),))


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
