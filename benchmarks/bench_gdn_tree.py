"""GDN tree verification on the GPU: ours (commit + verify) against serial, per-node and the floor.

Run on the H200 (FLA 0.6.0 carried as wheels, see README; or after the vLLM bundle's install, whose copy of
FLA's recurrent kernel serves the serial baseline):
    python benchmarks/bench_gdn_tree.py            # writes $OUT/gdn_tree.json (or benchmarks/results/)
    python benchmarks/bench_gdn_tree.py --quick    # a few shapes

Per step and request, every method must produce all tree outputs and leave the state of the
accepted path in the request's slot:
  ours      stash of the previous step's accepted path (its own inputs, <= depth + 1 tokens) +
            ``gdn_tree_step``: commits it in place and verifies the new tree (one launch for trees of one
            block, two for blocked trees: ``csrc_triton.gdn_tree.gdn_step``) (``ours_verify_only_ms``:
            verification alone);
  serial    FLA ``fused_recurrent_gated_delta_rule`` along every root-to-leaf path (one varlen
            launch, initial states gathered per path) + copy of the accepted path's final state;
  per_node  one fused Triton kernel walking the nodes in topological order, each node's full
            state from its parent's, all N states written (SGLang / vLLM style) + copy of the
            accepted node's state into the slot;
  floor     max(bytes / copy bandwidth, flops / bf16 matmul rate), both measured here: state read
            once and written once, node inputs read and outputs written once, accepted path read.
N counts the tree's nodes including its root (tokens per request in the verify forward).
Tree shapes: random recursive trees (depth <= 16) from a fixed seed; accepted path: a random
root-to-node path. Inputs bf16, gates fp32, state fp32.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import bench_ms, device_ceilings, write_results  # noqa: E402
from benchmarks.tree_cases import (  # noqa: E402
    accepted_flat, finish_case, print_summary, root_to_leaf_paths, seeded_trees, to_device,
)
from vllm_bole.gdn import PendingPath, gdn_tree_step, stash_accepted_path  # noqa: E402
from vllm_bole.testing.oracles import gdn_tree_reference  # noqa: E402

GRID_Z_MAX = 65535  # CUDA's limit on a grid's z axis (FLA's serial kernel: one program per path and value head)
CONFIGS = {"qwen3next-80b": (16, 32, 128, 128), "qwen3next-80b-tp2": (8, 16, 128, 128)}


@triton.jit
def per_node_kernel(q, k, v, g, beta, o, parent_flat, cu_nodes, states, state0, state_idx, scale,
                    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Baseline: node by node, full [K, BV] state per node written to ``states`` [T, Hv, K, V]."""
    b, h, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (Hv // Hk)
    o_k = tl.arange(0, K)
    o_v = vt * BV + tl.arange(0, BV)
    slot = tl.load(state_idx + b).to(tl.int64)
    S0 = tl.load(state0 + ((slot * Hv + h) * K + o_k[:, None]) * V + o_v[None, :])
    bos = tl.load(cu_nodes + b)
    eos = tl.load(cu_nodes + b + 1)
    for i in range(bos, eos):
        p = tl.load(parent_flat + i)
        if p < 0:
            S = S0
        else:
            S = tl.load(states + ((p.to(tl.int64) * Hv + h) * K + o_k[:, None]) * V + o_v[None, :])
        kk = tl.load(k + (i * Hk + hk) * K + o_k).to(tl.float32)
        qq = tl.load(q + (i * Hk + hk) * K + o_k).to(tl.float32)
        kk = kk / tl.sqrt(tl.sum(kk * kk) + 1e-6)
        qq = qq / tl.sqrt(tl.sum(qq * qq) + 1e-6)
        vv = tl.load(v + (i * Hv + h) * V + o_v).to(tl.float32)
        S = S * tl.exp(tl.load(g + i * Hv + h))
        delta = tl.load(beta + i * Hv + h) * (vv - tl.sum(S * kk[:, None], 0))
        S = S + kk[:, None] * delta[None, :]
        tl.store(states + ((i.to(tl.int64) * Hv + h) * K + o_k[:, None]) * V + o_v[None, :], S)
        tl.store(o + (i * Hv + h) * V + o_v, (tl.sum(S * qq[:, None], 0) * scale).to(o.dtype.element_ty))


def make_case(B, N, cfg, seed, dtype=torch.bfloat16, dev="cuda"):
    Hk, Hv, K, V = cfg
    tree, gen = seeded_trees(B, N, seed)
    T = tree.num_nodes
    q = torch.randn(T, Hk, K, generator=gen).to(dev, dtype)
    k = torch.randn(T, Hk, K, generator=gen).to(dev, dtype)
    v = torch.randn(T, Hv, V, generator=gen).to(dev, dtype)
    g = (-torch.rand(T, Hv, generator=gen) * 0.3).to(dev)
    beta = torch.rand(T, Hv, generator=gen).to(dev)
    return finish_case(dict(q=q, k=k, v=v, g=g, beta=beta), tree, gen)


def run_ours(c, state, pending, verify_only=False):
    """One decode step of ours: stash the previous accepted path, then commit it and verify the tree."""
    tree = c["tree_dev"]
    if verify_only:
        return lambda: gdn_tree_step(c["q"], c["k"], c["v"], c["g"], c["beta"], tree, state, c["slots_dev"], None)

    def step():
        stash_accepted_path(pending, c["slots_dev"], tree, c["acc_dev"], c["k"], c["v"], c["g"], c["beta"])
        return gdn_tree_step(c["q"], c["k"], c["v"], c["g"], c["beta"], tree, state, c["slots_dev"], pending,
                             reset_pending=False)  # as the engine: the next stash sets the lengths

    return step


def serial_setup(c, state):
    """Root-to-leaf paths as FLA varlen sequences: FLA's own kernel, or where FLA is not installed vLLM's copy of
    it (``vllm.third_party.flash_linear_attention``: states [V, K] in a buffer addressed by
    ``ssm_state_indices`` [paths, max length], read from and written back to the column of each path's last
    token (``num_accepted_tokens`` = its length, 0 = skip elsewhere): one state read and one write per path, as
    FLA's; the paths' initial states gathered transposed into that buffer, the same bytes as FLA's gather).
    FLA launches one program per (path, value head) on the grid's z axis, at most 65535: the paths go in
    chunks of at most ``65535 // Hv`` (one launch each; B = 32 trees of 128 nodes need two)."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        vllm_copy = False
    except ImportError:
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule
        vllm_copy = True

    paths = root_to_leaf_paths(c["tree"], c["acc_node"])
    idx = torch.tensor(paths["rows"], device="cuda")
    cu_t = torch.tensor(paths["cu"], device="cuda")
    req_t = c["slots_dev"].long()[torch.tensor(paths["req"], device="cuda")]
    # the slot receives the final state of a path through the accepted node (the same bytes as
    # that node's own state, which serial decoding would have to stop at)
    acc_paths = torch.tensor(paths["acc_path"], device="cuda")
    slots = c["slots_dev"].long()
    if vllm_copy:  # row 0 of the buffer is vLLM's null slot
        lens = cu_t.diff()
        n = lens.numel()
        own = torch.arange(1, n + 1, device="cuda", dtype=torch.int32)
        state_rows = torch.zeros(n, int(lens.max()), device="cuda", dtype=torch.int32)
        state_rows[torch.arange(n, device="cuda"), lens - 1] = own
        num_accepted = lens.to(torch.int32)
        Hv, K, V = state.shape[1:]
        h0 = torch.empty(n + 1, Hv, V, K, device="cuda", dtype=state.dtype)

    n_paths, per = cu_t.numel() - 1, GRID_Z_MAX // state.shape[1]
    chunks = [(a, min(a + per, n_paths)) for a in range(0, n_paths, per)]
    cu_host = paths["cu"]

    def inputs(a, b):
        rows = idx[cu_host[a] : cu_host[b]]
        return dict(q=c["q"][rows][None], k=c["k"][rows][None], v=c["v"][rows][None], g=c["g"][rows][None],
                    beta=c["beta"][rows][None], use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t[a : b + 1] - cu_host[a])

    def run():
        if vllm_copy:
            h0[1:] = state[req_t].transpose(-1, -2)
            o = [fused_recurrent_gated_delta_rule(**inputs(a, b), initial_state=h0, inplace_final_state=True,
                                                  ssm_state_indices=state_rows[a:b],
                                                  num_accepted_tokens=num_accepted[a:b])[0] for a, b in chunks]
            state[slots] = h0[1 + acc_paths].transpose(-1, -2)
        else:
            outs = [fused_recurrent_gated_delta_rule(**inputs(a, b), initial_state=state[req_t[a:b]],
                                                     output_final_state=True) for a, b in chunks]
            o = [out for out, _ in outs]
            state[slots] = torch.cat([ht for _, ht in outs])[acc_paths]
        return o

    return run, len(paths["rows"])


def per_node_setup(c, state, cfg, block_v=32):
    Hk, Hv, K, V = cfg
    tree = c["tree_dev"]
    T = tree.num_nodes
    states = torch.empty(T, Hv, K, V, device="cuda", dtype=torch.float32)
    o = torch.empty(T, Hv, V, device="cuda", dtype=c["v"].dtype)
    pflat = tree.parent_flat.to(torch.int32)
    acc_flat = accepted_flat(tree, c["acc_node"], "cuda")
    slots = c["slots_dev"].long()

    def run():
        per_node_kernel[(tree.num_requests, Hv, V // block_v)](
            c["q"], c["k"], c["v"], c["g"], c["beta"], o, pflat, tree.cu_nodes, states, state, c["slots_dev"],
            K**-0.5, Hk=Hk, Hv=Hv, K=K, V=V, BV=block_v, num_warps=4)
        state[slots] = states[acc_flat]
        return o

    return run, states.numel() * 4


def floor_ms(B, N, m_mean, cfg, ceil):
    Hk, Hv, K, V = cfg
    T = B * N
    state_bytes = B * Hv * K * V * 4
    in_bytes = T * (2 * Hk * K * 2 + Hv * V * 2 + 2 * Hv * 4) + T * Hv * V * 2  # inputs + output
    path_bytes = B * m_mean * (Hk * K * 2 + Hv * V * 2 + 2 * Hv * 4) * 2  # stash write + read
    bytes_ = 2 * state_bytes + in_bytes + path_bytes
    flops = B * Hv * (4 * N * K * V + 4 * N * N * (K + V) + 4 * m_mean * K * V)
    return max(bytes_ / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e3, bytes_, flops


def check_accuracy(cfg, dtype, seed=0):
    """ours vs the float64 oracle on the GPU for every tree size (B = 4), incl. the commit."""
    Hk, Hv, K, V = cfg
    out = {}
    for N in (8, 16, 32, 64, 128):
        c = to_device(make_case(4, N, cfg, seed + N, dtype), "cuda")
        slots = c["slots_dev"]
        state = torch.randn(4, Hv, K, V, device="cuda")
        o = gdn_tree_step(c["q"], c["k"], c["v"], c["g"], c["beta"], c["tree_dev"], state, slots, None)
        o_ref, st_ref = gdn_tree_reference(c["tree_dev"], c["q"], c["k"], c["v"], c["g"], c["beta"], state[slots.long()])
        err_o = float((o.double() - o_ref).norm() / o_ref.norm())
        pending = PendingPath.empty(4, c["P"], Hk, Hv, K, V, dtype=dtype, device="cuda")
        stash_accepted_path(pending, slots, c["tree_dev"], c["acc_dev"], c["k"], c["v"], c["g"], c["beta"])
        gdn_tree_step(None, None, None, None, None, None, state, slots, pending)
        want = st_ref[accepted_flat(c["tree"], c["acc_node"], "cuda")]
        err_s = float((state[slots.long()].double() - want).norm() / want.norm())
        out[N] = (err_o, err_s)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceil = device_ceilings()
    acc = {f"{name}/{str(dt).split('.')[-1]}": check_accuracy(cfg, dt)
           for name, cfg in CONFIGS.items() for dt in (torch.bfloat16, torch.float32)}
    for key, errs in acc.items():
        print("accuracy", key, {n: f"o {e[0]:.1e} state {e[1]:.1e}" for n, e in errs.items()})
    Bs, Ns = ((1, 32), (16, 64)) if args.quick else ((1, 8, 32, 128), (8, 16, 32, 64, 128))
    rows = []
    for name, cfg in CONFIGS.items():
        Hk, Hv, K, V = cfg
        for B in Bs:
            for N in Ns:
                c = to_device(make_case(B, N, cfg, seed=1000 * B + N), "cuda")
                state = torch.randn(B, Hv, K, V, device="cuda") * 0.1
                pending = PendingPath.empty(B, c["P"], Hk, Hv, K, V, dtype=torch.bfloat16, device="cuda")
                m_mean = c["m_mean"]
                ours = bench_ms(run_ours(c, state, pending))
                verify_only = bench_ms(run_ours(c, state, pending, verify_only=True))
                serial_fn, serial_tokens = serial_setup(c, state)
                serial = bench_ms(serial_fn)
                pn_fn, pn_bytes = per_node_setup(c, state, cfg)
                per_node = bench_ms(pn_fn)
                del pn_fn
                fl, bytes_, flops = floor_ms(B, N, m_mean, cfg, ceil)
                ours_transient = B * c["P"] * (Hk * K * 2 + Hv * V * 2 + 2 * Hv * 4)
                rows.append(dict(
                    config=name, B=B, N=N, ours_ms=ours, serial_ms=serial, per_node_ms=per_node, floor_ms=fl,
                    ours_transient_bytes=ours_transient, per_node_transient_bytes=pn_bytes,
                    ours_verify_only_ms=verify_only, floor_bytes=bytes_, floor_flops=flops,
                    mean_accepted_path=m_mean, max_depth=c["tree"].max_depth, serial_path_tokens=serial_tokens,
                    Hk=Hk, Hv=Hv, K=K, V=V,
                ))
                r = rows[-1]
                print(f"{name:18s} B={B:4d} N={N:4d} ours {ours:8.4f} ms (verify {verify_only:.4f}) "
                      f"serial {serial:8.4f} per_node {per_node:8.4f} floor {fl:.4f} | x floor {ours / fl:5.2f} "
                      f"serial/ours {serial / ours:6.1f} per_node/ours {per_node / ours:6.1f} "
                      f"mem {pn_bytes / ours_transient:7.1f}x", flush=True)
                torch.cuda.empty_cache()
    write_results("gdn_tree.json", rows, extra=dict(ceilings=ceil, accuracy=acc, configs=CONFIGS))
    print_summary(rows)


if __name__ == "__main__":
    main()
