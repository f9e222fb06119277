"""The vLLM adapter's GPU code paths on the H200, without vLLM (it does not install there).

What runs is the adapter's own code: the layer overrides of ``vllm_bole.adapter.layers`` (tree
attention on a FLASH_ATTN-layout cache, GDN through the ``_forward_core`` hook with vLLM's CUDA
state layout ``[S, Hv, V, K]``, Mamba2 through ``conv_ssm_forward``) and the model runner's commit
and pending flush (``TreeRunnerMixin._bole_commit`` / ``_bole_flush_pending``), all with the
Triton kernels (``kernels: auto`` on CUDA). vLLM's layers are stood in for by objects carrying
the attributes the overrides read, with vLLM 0.33's cache layouts (read from its source):
attention ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` stored NHD; GDN conv state
``[S, W-1, C]`` (vLLM's default "SD" layout, the one stubbed function below), GDN state
``[S, Hv, V, K]``; Mamba2 conv ``[S, W-1, C]``, state ``[S, H, P, N]``.

Checks, per dtype (bf16 and fp32 activations; states fp32), on random trees (unique sibling
tokens) against the float64 sequential oracles:
1. every node's layer output (GDN core, Mamba2 ``y``, attention);
2. after greedy verification of logits that accept a random root-to-node path per request, the
   runner's commit (K/V compaction, conv commit, stash) then its pending flush: each request's
   recurrent state, conv state and K/V prefix equal the oracle's state at the accepted node.
Writes ``adapter_gpu.json`` (``$OUT`` on the device). Run: ``python benchmarks/device/check_adapter_gpu.py``
(on CPU it runs small under ``TRITON_INTERPRET=1``, fp32 only).
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# vLLM's conv-state layout switch, the only vLLM function the overrides call: default "SD" layout.
_mu = types.ModuleType("vllm.model_executor.layers.mamba.mamba_utils")
_mu.is_conv_state_dim_first = lambda: False
for _name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
sys.modules[_mu.__name__] = _mu

from benchmarks.harness import write_results  # noqa: E402
from vllm_bole.adapter import layers as L  # noqa: E402
from vllm_bole.adapter.runner import TreeRunnerMixin  # noqa: E402
from vllm_bole.config import TreeSpecConfig  # noqa: E402
from vllm_bole.spec_decode.tree import TreeBatch  # noqa: E402
from vllm_bole.spec_decode.verification import verify_greedy  # noqa: E402
from vllm_bole.testing import oracles as O  # noqa: E402
from vllm_bole.testing.stats import rel_err  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
IMPL = "auto" if CUDA else "triton"
TOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}  # relative Frobenius (tf32 / bf16 dot operands on GPU)


class FlashAttentionImpl:  # the class name is what the adapter dispatches on
    def __init__(self, num_heads, head_size):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, head_size**-0.5
        self.sliding_window, self.kv_cache_dtype = (-1, -1), "auto"

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kw):
        raise AssertionError("no plain requests in these steps: vLLM's own attention must not run")


class Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _tree(B, N, D, gen):
    """Random trees with unique tokens (token = flat index + 1), depth <= D."""
    parents = [O.random_tree(int(torch.randint(max(2, N // 2), N + 1, (1,), generator=gen)), max_depth=D,
                             generator=gen) for _ in range(B)]
    toks, t = [], 1
    for p in parents:
        toks.append(list(range(t, t + len(p))))
        t += len(p)
    return TreeBatch.from_parents(parents, toks), t


def _accepting_logits(tree, vocab, gen):
    """Logits whose greedy verification accepts the path to a random leaf of every request."""
    logits = torch.randn(tree.num_nodes, vocab, generator=gen) * 0.1
    logits[:, 0] = 5.0  # off-tree token: stop
    for r in range(tree.num_requests):
        par, _ = tree.request(r)
        leaves = [j for j in range(len(par)) if j not in set(par)]
        node = leaves[int(torch.randint(len(leaves), (1,), generator=gen))]
        path = tree.root_path(r, node)
        base = int(tree.cu_nodes[r])
        for a, b in zip(path[:-1], path[1:]):
            logits[base + a, int(tree.token_ids[base + b])] = 50.0
    return logits


def _gdn_layer(S, Hk, Hv, K, V, W, dtype, gen):
    C = 2 * Hk * K + Hv * V
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731

    class Layer(Obj):
        def forward_cuda(self, hidden_states):
            raise AssertionError("not called: the override hooks _forward_core")

        def _forward_core(self, mixed_qkv, b, a, core):
            raise AssertionError("no plain requests in these steps: vLLM's own GDN core must not run")

        def rearrange_mixed_qkv(self, x):
            q, k, v = x.split([Hk * K, Hk * K, Hv * V], dim=-1)
            return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # vLLM returns [1, T, ...]

    layer = Layer(tp_size=1, num_k_heads=Hk, num_v_heads=Hv, head_k_dim=K, head_v_dim=V, activation="silu",
                  conv1d=Obj(weight=(r(C, 1, W) * 0.5).to(DEV, dtype), bias=(r(C) * 0.1).to(DEV, dtype)),
                  A_log=(r(Hv) * 0.3).to(DEV), dt_bias=(r(Hv) * 0.3).to(DEV),
                  in_proj_ba=Obj(weight=torch.empty(1, dtype=dtype)),
                  kv_cache=((r(S, W - 1, C)).to(DEV, dtype), (r(S, Hv, V, K) * 0.3).to(DEV)))
    layer._forward_method = layer.forward_cuda
    return layer, C


def _mamba2_layer(S, H, P, G, N, W, dtype, gen):
    conv = H * P + 2 * G * N
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    layer = Obj(tp_size=1, num_heads=H, head_dim=P, n_groups=G, ssm_state_size=N, activation="silu",
                tped_intermediate_size=H * P, tped_conv_size=conv, tped_dt_size=H, use_replayssm=False,
                conv_weights=(r(conv, W) * 0.5).to(DEV, dtype), conv1d=Obj(bias=(r(conv) * 0.1).to(DEV, dtype),
                                                                             weight=torch.empty(1, dtype=dtype)),
                A=-(torch.rand(H, generator=gen) + 0.2).to(DEV), D=r(H).to(DEV), dt_bias=(r(H) * 0.3).to(DEV),
                kv_cache=(r(S, W - 1, conv).to(DEV, dtype), (r(S, H, P, N) * 0.3).to(DEV)))
    layer.split_hidden_states_B_C_fn = lambda x: x.split([H * P, G * N, G * N], dim=-1)
    layer.conv_ssm_forward = lambda projected_states, output: (_ for _ in ()).throw(
        AssertionError("no plain requests in these steps: vLLM's own Mamba2 path must not run"))
    return layer, conv


def check(dtype, B, N, D, big):
    gen = torch.Generator().manual_seed(1234 + B + N + D)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    tree_h, vocab = _tree(B, N, D, gen)
    tree = tree_h.to(DEV)
    T = tree.num_nodes
    S = B + 3
    slots = torch.randperm(S, generator=gen)[:B].to(DEV)
    Hk, Hv, K, V = (2, 4, 128, 128) if big else (1, 2, 16, 32)
    H, P, G, Nst = (16, 64, 2, 64) if big else (4, 16, 2, 8)
    Hq, Hkv, Dh, bs = (8, 2, 128, 16) if big else (4, 2, 32, 16)
    W = 4

    gdn, Cg = _gdn_layer(S, Hk, Hv, K, V, W, dtype, gen)
    mam, Cm = _mamba2_layer(S, H, P, G, Nst, W, dtype, gen)
    prefix = torch.randint(1, 40, (B,), generator=gen)
    nblk = (int(prefix.max()) + N + bs) // bs + 1
    block_table = torch.randperm(B * nblk, generator=gen).view(B, nblk).to(torch.int32)  # disjoint, shuffled
    phys = r(B * nblk, bs, Hkv, 2 * Dh).to(DEV, dtype)  # NHD storage of the logical [blocks, Hkv, bs, 2D] cache
    impl = FlashAttentionImpl(Hq, Dh)
    attn = Obj(impl=impl, kv_cache=phys.permute(0, 2, 1, 3))
    L.install_gdn("gdn", gdn)
    L.install_mamba2("mamba", mam)
    L.install_attention("attn", attn)

    cfg = TreeSpecConfig(method="bole_tree", drafter="ngram", num_speculative_tokens=max(N - 1, 1), max_depth=D)
    runner = Obj(compilation_config=Obj(static_forward_context={"gdn": gdn, "mamba": mam, "attn": attn}),
                 _bole_attn_groups={1: ["attn"]}, _bole_state_groups={0: ["gdn", "mamba"]}, bole_config=cfg,
                 _bole_pending_slots={}, _bole_layer_kind={"gdn": "gdn", "mamba": "mamba2"}, device=DEV)
    runner._bole_pending = {"gdn": L.gdn_pending(gdn, S, cfg.depth + 1), "mamba": L.mamba2_pending(mam, S, cfg.depth + 1)}
    step = L.TreeStep(num_plain=0, tok_start=0, tree=tree, prefix_len=prefix.to(DEV), req_ids=[f"r{i}" for i in range(B)],
                      layer_group={"gdn": 0, "mamba": 0, "attn": 1}, block_tables={1: block_table.to(DEV)},
                      state_slots={0: slots}, pending=runner._bole_pending, fresh=torch.zeros(B, dtype=torch.bool, device=DEV),
                      impl=IMPL)
    kc, vc, triton_ok = L.attention_kv_views(attn)
    assert triton_ok

    # inputs (rounded to the activation dtype; the oracles read the same rounded values)
    mixed_qkv, a_in, b_in = r(T, Cg).to(DEV, dtype), r(T, Hv).to(DEV, dtype), r(T, Hv).to(DEV, dtype)
    ps = torch.cat([r(T, H * P), r(T, Cm), r(T, H)], dim=-1).to(DEV, dtype)
    q, k, v = (r(T, Hq, Dh).to(DEV, dtype), r(T, Hkv, Dh).to(DEV, dtype), r(T, Hkv, Dh).to(DEV, dtype))
    req, loc = tree.request_index.long(), torch.arange(T, device=DEV) - tree.cu_nodes[tree.request_index].long()
    pos = prefix.to(DEV)[req] + loc  # KV slot of node j: prefix + j (vLLM writes them before forward)
    blk, off = block_table.to(DEV)[req, pos // bs].long(), pos % bs
    kc[blk, off], vc[blk, off] = k, v
    snap = dict(gdn_ssm=gdn.kv_cache[1].clone(), gdn_conv=gdn.kv_cache[0].clone(), m_ssm=mam.kv_cache[1].clone(),
                m_conv=mam.kv_cache[0].clone(), kc=kc.clone(), vc=vc.clone())

    L.set_step(step)
    try:
        core = torch.zeros(T, Hv, V, device=DEV, dtype=dtype)
        gdn._forward_core(mixed_qkv, b_in, a_in, core)
        y = torch.zeros(T, H * P, device=DEV, dtype=dtype)
        mam.conv_ssm_forward(projected_states=ps, output=y)
        out = torch.zeros(T, Hq * Dh, device=DEV, dtype=dtype)
        impl.forward(attn, q.reshape(T, -1), k, v, attn.kv_cache, None, output=out)
    finally:
        L.set_step(None)
    torch.cuda.synchronize() if CUDA else None

    sl = slots.long()
    # the state as the core reads it: vLLM's CUDA layout [S, Hv, V, K] transposed; on CPU (a local run
    # of this script) the adapter takes vLLM's CPU kernels' reading of the same memory, [S, Hv, K, V]
    as_kv = (lambda st: st.transpose(-1, -2)) if CUDA else (lambda st: st.reshape(*st.shape[:-2], K, V))
    # --- oracles: GDN
    w_g = gdn.conv1d.weight.reshape(Cg, W)
    conv_y, conv_st = O.conv_tree_reference(tree, mixed_qkv, w_g, snap["gdn_conv"][sl].transpose(-1, -2),
                                            bias=gdn.conv1d.bias)
    qg, kg, vg = conv_y.split([Hk * K, Hk * K, Hv * V], dim=-1)
    g, beta = O.gdn_gating(a_in, b_in, gdn.A_log, gdn.dt_bias)
    o_ref, gdn_states = O.gdn_tree_reference(tree, qg.reshape(T, Hk, K), kg.reshape(T, Hk, K), vg.reshape(T, Hv, V),
                                             g, beta, as_kv(snap["gdn_ssm"][sl]))
    # --- Mamba2
    xBC, dt = ps[:, H * P:].split([Cm, H], dim=-1)
    m_y, m_conv_st = O.conv_tree_reference(tree, xBC, mam.conv_weights, snap["m_conv"][sl].transpose(-1, -2),
                                           bias=mam.conv1d.bias)
    xs, Bs, Cs = m_y.split([H * P, G * Nst, G * Nst], dim=-1)
    y_ref, m_states = O.ssd_tree_reference(tree, xs.reshape(T, H, P), dt, mam.A, Bs.reshape(T, G, Nst),
                                           Cs.reshape(T, G, Nst), snap["m_ssm"][sl], D=mam.D, dt_bias=mam.dt_bias)
    # --- attention: prefix K/V gathered per request
    kp, vp = [], []
    for i in range(B):
        p = torch.arange(int(prefix[i]), device=DEV)
        bb, oo = block_table.to(DEV)[i, p // bs].long(), p % bs
        kp.append(snap["kc"][bb, oo])
        vp.append(snap["vc"][bb, oo])
    a_ref = O.attention_tree_reference(tree, q, k, v, kp, vp, scale=impl.scale)
    errs = dict(gdn_out=rel_err(core, o_ref), mamba2_out=rel_err(y, y_ref.reshape(T, H * P)),
                attn_out=rel_err(out.reshape(T, Hq, Dh), a_ref))

    # --- verify, commit (runner code), flush the pending paths (runner code)
    res = verify_greedy(tree, _accepting_logits(tree_h, vocab + 1, gen).to(DEV))
    TreeRunnerMixin._bole_commit(runner, step, res)
    TreeRunnerMixin._bole_flush_pending(runner, exclude=set())
    last = res.last_node.long()
    m = res.num_accepted.long()
    e_gs, e_gc, e_ms, e_mc, e_kv = [], [], [], [], []
    for i in range(B):
        s, n = int(slots[i]), int(last[i])
        e_gs.append(rel_err(as_kv(gdn.kv_cache[1][s]), gdn_states[n]))
        e_gc.append(rel_err(gdn.kv_cache[0][s].transpose(-1, -2), conv_st[n]))
        e_ms.append(rel_err(mam.kv_cache[1][s], m_states[n]))
        e_mc.append(rel_err(mam.kv_cache[0][s].transpose(-1, -2), m_conv_st[n]))
        acc = res.accepted_nodes[i, : int(m[i]) + 1].long() + int(tree.cu_nodes[i])
        p = int(prefix[i]) + torch.arange(int(m[i]) + 1, device=DEV)
        bb, oo = block_table.to(DEV)[i, p // bs].long(), p % bs
        e_kv.append(max(float((kc[bb, oo] - k[acc]).abs().max()), float((vc[bb, oo] - v[acc]).abs().max())))
    errs.update(gdn_state=max(e_gs), gdn_conv_state=max(e_gc), mamba2_state=max(e_ms), mamba2_conv_state=max(e_mc),
                kv_compaction_max_abs=max(e_kv))
    ok = all(v <= TOL[dtype] for key, v in errs.items() if key != "kv_compaction_max_abs") and errs[
        "kv_compaction_max_abs"] == 0.0
    return dict(dtype=str(dtype).replace("torch.", ""), B=B, N=N, D=D, accepted=m.tolist(), ok=ok, tol=TOL[dtype],
                **{k_: round(v_, 7) for k_, v_ in errs.items()})


def main():
    big = CUDA
    cases = [(4, 9, 4), (3, 16, 16), (8, 32, 8)] if big else [(2, 6, 3), (2, 8, 8)]
    dtypes = [torch.bfloat16, torch.float32] if big else [torch.float32]
    rows = []
    for dt in dtypes:
        for B, N, D in cases:
            row = check(dt, B, N, D, big)
            rows.append(row)
            print(row, flush=True)
    passed = all(r["ok"] for r in rows)
    path = write_results("adapter_gpu.json", rows, dict(passed=passed, impl=IMPL,
                                                       shapes=dict(gdn="Hk 2, Hv 4, K=V 128", mamba2="H 16, P 64, G 2, N 64",
                                                                   attention="Hq 8, Hkv 2, D 128, block 16") if big else "small"))
    print(("PASSED" if passed else "FAILED"), path)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
