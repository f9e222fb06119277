"""Mamba2/SSD tree verification on the GPU: ours (stash + fused commit/verify step) against serial, per-node and the floor.

Run on the H200 (under 6 minutes):
    python benchmarks/bench_mamba2_tree.py            # writes $OUT/mamba2_tree.json (or benchmarks/results/)
    python benchmarks/bench_mamba2_tree.py --quick    # a few shapes (and the launch-config probe at B = 32, N = 64)
    TRITON_INTERPRET=1 python benchmarks/bench_mamba2_tree.py --smoke   # CPU: tiny shapes, every
                                                      # method once and checked, no timing, no file

Shapes: Nemotron-H-8B-class Mamba2 layers (128 heads of head_dim 64, d_state 128, 8 groups) and
their TP=2 shard (64 heads, 4 groups). Per step and request, every method must produce all tree
outputs y (h C + D x, before the gated norm) and leave the state of the accepted path in the
request's slot:
  ours      ``stash_accepted_path`` of the previous step's accepted path (its own x, raw dt, B:
            <= depth + 1 tokens) + one ``ssd_tree_step`` launch that commits it in place and
            verifies the new tree (extras: verify alone; stash + commit launch + verify launch);
  serial    one launch of our selective-state-update style Triton kernel walking every
            root-to-leaf path token by token (program per path, head, P tile; state from the
            slot, one token at a time, y per node), the accepted node's state written to a
            scratch buffer, then copied into the slots (a path's programs read the slot, so the
            write cannot go in place);
  per_node  one fused Triton kernel walking the nodes in topological order, each node's full
            state from its parent's, all N states written (SGLang / vLLM style), + copy of the
            accepted node's state into the slot;
  floor     max(bytes / copy bandwidth, flops / bf16 matmul rate), both measured here: state read
            once and written once, node inputs (x, dt, B, C) read and y written once, accepted
            path stashed and read back; flops of C h^T, the masked (C B^T) X per head, C B^T per
            group and the commit.
N counts the tree's nodes including its root. Trees: random recursive (depth <= 16) from a fixed
seed; accepted path: a random root-to-node path (benchmarks/tree_cases.py, shared with the GDN
benchmark). Inputs x, dt, B, C bf16; A, D, dt_bias fp32; state fp32; dt_limit (0, inf) as vLLM.
Accuracy: ours against the float64 oracle on the GPU for bf16 and fp32 inputs (outputs and the
committed state), and both baselines against the oracle, before any timing.
"""
import argparse
import itertools
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import bench_ms, device_ceilings, write_results  # noqa: E402
from benchmarks.tree_cases import (  # noqa: E402
    accepted_flat, baseline_errors, finish_case, print_summary, rel_err, root_to_leaf_paths, seeded_trees, to_device,
)
from vllm_bole.mamba.ssd_tree import PendingPath, ssd_tree_step, stash_accepted_path  # noqa: E402
from vllm_bole.testing.oracles import ssd_tree_reference  # noqa: E402

CONFIGS = {"nemotron-h-8b": (128, 8, 64, 128), "nemotron-h-8b-tp2": (64, 4, 64, 128)}  # H, G, P, N (d_state)
SMOKE_CONFIGS = {"tiny": (4, 2, 32, 16)}


# ------------------------------------------------------------------------------- baselines
@triton.jit
def _dt_eff(dt, bias_h):
    d = dt.to(tl.float32) + bias_h
    return tl.where(d <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)  # softplus; dt_limit (0, inf)


@triton.jit
def _token(S, x, dt, Bm, Cm, y, i, h, g, A_h, D_h, bias_h, o_p, o_n, H: tl.constexpr, G: tl.constexpr,
           P: tl.constexpr, N: tl.constexpr):
    """One selective-state update of the [BP, N] tile with node i (int64); writes y[i]; returns the state."""
    d = _dt_eff(tl.load(dt + i * H + h), bias_h)
    xv = tl.load(x + (i * H + h) * P + o_p).to(tl.float32)
    bv = tl.load(Bm + (i * G + g) * N + o_n).to(tl.float32)
    cv = tl.load(Cm + (i * G + g) * N + o_n).to(tl.float32)
    S = S * tl.exp(d * A_h) + (d * xv)[:, None] * bv[None, :]
    tl.store(y + (i * H + h) * P + o_p, (tl.sum(S * cv[None, :], 1) + D_h * xv).to(y.dtype.element_ty))
    return S


@triton.jit
def serial_kernel(x, dt, Bm, Cm, y, A, D, dt_bias, path_rows, path_cu, path_req, path_acc,
                  state, state_idx, scratch,
                  H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr):
    """Baseline (a): program (root-to-leaf path, head, P tile) walks its path token by token from
    the slot's state; the accepted node's state goes to scratch[request]."""
    pth, h, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    o_p = pt * BP + tl.arange(0, BP)
    o_n = tl.arange(0, N)
    r = tl.load(path_req + pth)
    slot = tl.load(state_idx + r).to(tl.int64)
    A_h = tl.load(A + h)
    D_h = tl.load(D + h)
    bias_h = tl.load(dt_bias + h)
    S = tl.load(state + ((slot * H + h) * P + o_p[:, None]) * N + o_n[None, :])
    start = tl.load(path_cu + pth)
    end = tl.load(path_cu + pth + 1)
    acc = tl.load(path_acc + pth)
    for t in range(start, end):
        S = _token(S, x, dt, Bm, Cm, y, tl.load(path_rows + t).to(tl.int64), h, g, A_h, D_h, bias_h, o_p, o_n, H, G, P, N)
        if t - start == acc:
            tl.store(scratch + ((r.to(tl.int64) * H + h) * P + o_p[:, None]) * N + o_n[None, :], S)


@triton.jit
def per_node_kernel(x, dt, Bm, Cm, y, A, D, dt_bias, parent_flat, cu_nodes, states, state, state_idx,
                    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr):
    """Baseline (b): node by node in topological order, full [BP, N] state per node written to
    ``states`` [T, H, P, N] (each from its parent's, or the slot's for the root)."""
    b, h, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    o_p = pt * BP + tl.arange(0, BP)
    o_n = tl.arange(0, N)
    slot = tl.load(state_idx + b).to(tl.int64)
    A_h = tl.load(A + h)
    D_h = tl.load(D + h)
    bias_h = tl.load(dt_bias + h)
    tile = (h * P + o_p[:, None]) * N + o_n[None, :]
    S0 = tl.load(state + slot * H * P * N + tile)
    for i in range(tl.load(cu_nodes + b).to(tl.int64), tl.load(cu_nodes + b + 1).to(tl.int64)):
        p = tl.load(parent_flat + i)
        if p < 0:
            S = S0
        else:
            S = tl.load(states + p.to(tl.int64) * H * P * N + tile)
        S = _token(S, x, dt, Bm, Cm, y, i, h, g, A_h, D_h, bias_h, o_p, o_n, H, G, P, N)
        tl.store(states + i * H * P * N + tile, S)
        tl.debug_barrier()


# ------------------------------------------------------------------------------- cases, methods
def make_case(B, N, cfg, seed, dtype=torch.bfloat16, dev="cuda"):
    H, G, P, Nst = cfg
    tree, gen = seeded_trees(B, N, seed)
    T = tree.num_nodes
    x = torch.randn(T, H, P, generator=gen).to(dev, dtype)
    dt = (torch.randn(T, H, generator=gen) * 0.5).to(dev, dtype)
    Bm = (torch.randn(T, G, Nst, generator=gen) * 0.5).to(dev, dtype)
    Cm = (torch.randn(T, G, Nst, generator=gen) * 0.5).to(dev, dtype)
    # Mamba2 init: A = -exp(A_log), A_log ~ log U[1, 16]; dt_bias = softplus^-1(dt0), dt0 ~ logU[1e-3, 1e-1]
    A = -(torch.rand(H, generator=gen) * 15 + 1).to(dev)
    dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(dev)
    D = (1.0 + 0.1 * torch.randn(H, generator=gen)).to(dev)
    return finish_case(dict(x=x, dt=dt, Bm=Bm, Cm=Cm, A=A, D=D, dt_bias=dt_bias), tree, gen)


def layer_kw(c):
    """The layer's constants, and kernels="triton" (the default on CUDA; the kernels under --smoke)."""
    return dict(D=c["D"], dt_bias=c["dt_bias"], dt_softplus=True, dt_limit=(0.0, float("inf")), kernels="triton")


def run_ours(c, state, pending, verify_only=False, two_pass=False):
    tree, slots, kw = c["tree_dev"], c["slots_dev"], layer_kw(c)
    args = (c["x"], c["dt"], c["A"], c["Bm"], c["Cm"], tree, state, slots)
    if verify_only:
        return lambda: ssd_tree_step(*args, None, **kw)

    def step():
        stash_accepted_path(pending, slots, tree, c["acc_dev"], c["x"], c["dt"], c["Bm"], kernels="triton")
        if two_pass:
            ssd_tree_step(None, None, c["A"], None, None, None, state, slots, pending, **kw)
            return ssd_tree_step(*args, None, **kw)
        return ssd_tree_step(*args, pending, reset_pending=False, **kw)  # as the engine

    return step


def serial_setup(c, state, cfg, block_p=32):
    H, G, P, Nst = cfg
    dev = state.device
    paths = root_to_leaf_paths(c["tree"], c["acc_node"])
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    rows, cu, req, acc_pos = i32(paths["rows"]), i32(paths["cu"]), i32(paths["req"]), i32(paths["acc_pos"])
    B = c["tree"].num_requests
    scratch = torch.empty(B, H, P, Nst, device=dev, dtype=torch.float32)
    y = torch.empty(c["tree"].num_nodes, H, P, device=dev, dtype=c["x"].dtype)
    slots = c["slots_dev"].long()

    def run():
        serial_kernel[(len(paths["req"]), H, P // block_p)](
            c["x"], c["dt"], c["Bm"], c["Cm"], y, c["A"], c["D"], c["dt_bias"], rows, cu, req, acc_pos,
            state, c["slots_dev"], scratch, H=H, G=G, P=P, N=Nst, BP=block_p, num_warps=4)
        state.index_copy_(0, slots, scratch)
        return y

    return run, len(paths["rows"])


def per_node_setup(c, state, cfg, block_p=32):
    H, G, P, Nst = cfg
    dev = state.device
    tree = c["tree_dev"]
    T = tree.num_nodes
    states = torch.empty(T, H, P, Nst, device=dev, dtype=torch.float32)
    y = torch.empty(T, H, P, device=dev, dtype=c["x"].dtype)
    pflat = tree.parent_flat.to(torch.int32)
    acc_flat = accepted_flat(tree, c["acc_node"], dev)
    slots = c["slots_dev"].long()

    def run():
        per_node_kernel[(tree.num_requests, H, P // block_p)](
            c["x"], c["dt"], c["Bm"], c["Cm"], y, c["A"], c["D"], c["dt_bias"], pflat, tree.cu_nodes, states, state,
            c["slots_dev"], H=H, G=G, P=P, N=Nst, BP=block_p, num_warps=4)
        state[slots] = states[acc_flat]
        return y

    return run, states.numel() * 4


def input_row_bytes(cfg, with_c=True):
    """Bytes of one node's bf16 inputs (x, dt, B and optionally C)."""
    H, G, P, Nst = cfg
    return H * P * 2 + H * 2 + G * Nst * 2 * (2 if with_c else 1)


def floor_ms(B, N, m_mean, cfg, ceil):
    H, G, P, Nst = cfg
    T = B * N
    state_bytes = B * H * P * Nst * 4
    in_bytes = T * input_row_bytes(cfg) + T * H * P * 2  # inputs + output
    path_bytes = B * m_mean * input_row_bytes(cfg, with_c=False) * 2  # stash write + read
    bytes_ = 2 * state_bytes + in_bytes + path_bytes
    flops = B * (G * 2 * N * N * Nst + H * (2 * N * Nst * P + 2 * N * N * P + 2 * m_mean * Nst * P))
    return max(bytes_ / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e3, bytes_, flops



def check_accuracy(cfg, dtype, dev, Ns=(8, 16, 32, 64, 128), B=4, seed=0):
    """ours vs the float64 oracle for every tree size: outputs, and the state after the stash +
    commit of the accepted path (the oracle's state at the accepted node)."""
    H, G, P, Nst = cfg
    out = {}
    for N in Ns:
        c = to_device(make_case(B, N, cfg, seed + N, dtype, dev), dev)
        slots, kw = c["slots_dev"], layer_kw(c)
        state = torch.randn(B, H, P, Nst, device=dev)
        y = ssd_tree_step(c["x"], c["dt"], c["A"], c["Bm"], c["Cm"], c["tree_dev"], state, slots, None, **kw)
        kw.pop("kernels")
        y_ref, st_ref = ssd_tree_reference(c["tree_dev"], c["x"], c["dt"], c["A"], c["Bm"], c["Cm"], state[slots.long()], **kw)
        pending = PendingPath.empty(B, c["P"], H, G, P, Nst, dtype=dtype, device=dev)
        stash_accepted_path(pending, slots, c["tree_dev"], c["acc_dev"], c["x"], c["dt"], c["Bm"], kernels="triton")
        ssd_tree_step(None, None, c["A"], None, None, None, state, slots, pending, kernels="triton", **kw)
        want = st_ref[accepted_flat(c["tree"], c["acc_node"], dev)]
        out[N] = (rel_err(y, y_ref), rel_err(state[slots.long()], want))
        del st_ref
    return out


def check_baselines(cfg, dtype, dev, B=3, N=16, seed=5):
    """serial and per_node against the oracle: all outputs and the accepted states in the slots."""
    H, G, P, Nst = cfg
    c = to_device(make_case(B, N, cfg, seed, dtype, dev), dev)
    state = torch.randn(B, H, P, Nst, device=dev)
    kw = layer_kw(c)
    kw.pop("kernels")
    y_ref, st_ref = ssd_tree_reference(c["tree_dev"], c["x"], c["dt"], c["A"], c["Bm"], c["Cm"], state[c["slots_dev"].long()], **kw)
    want = st_ref[accepted_flat(c["tree"], c["acc_node"], dev)]
    return baseline_errors(c, state, cfg, dict(serial=serial_setup, per_node=per_node_setup), y_ref, want)


def probe_configs(cfg, B, N, dev, cb_only=False):
    """ours (stash + fused step) over kernel launch configs (P tile, node rows per block, warps; the
    defaults at N = 64, d_state 128: BP 64, two blocks of 32 rows, 4 warps; and the defaults with the group's
    C B^T tiles from ``ssd_cb_kernel`` or not, ``default_cb1`` / ``default_cb0``), for choosing defaults:
    per config [ms, relative error of y and of the state against the defaults' step from the same state];
    ``cb_only``: those two alone."""
    from csrc_triton.ssd_tree import ssd_tree_step as launch

    H, G, P, Nst = cfg
    c = to_device(make_case(B, N, cfg, seed=77, dev=dev), dev)
    state0 = torch.randn(B, H, P, Nst, device=dev) * 0.1
    state = state0.clone()
    pending = PendingPath.empty(B, c["P"], H, G, P, Nst, device=dev)
    kw = layer_kw(c)

    def step(**config):
        stash_accepted_path(pending, c["slots_dev"], c["tree_dev"], c["acc_dev"], c["x"], c["dt"], c["Bm"])
        return launch(c["x"], c["dt"], c["A"], c["Bm"], c["Cm"], c["tree_dev"], state, c["slots_dev"], pending,
                      kw["D"], kw["dt_bias"], True, kw["dt_limit"], **config)

    def once(**config):  # one step from state0: (y, state)
        state.copy_(state0)
        return step(**config), state.clone()

    y_ref, s_ref = once()
    res = {}
    grid = [] if cb_only else itertools.product((32, 64), (64, 32, 16), (4, 8))  # P tile, rows per block, warps
    configs = {f"BP{bp}_BR{br}_w{nw}": dict(block_p=bp, block_r=br, num_warps=nw) for bp, br, nw in grid}
    configs |= {f"default_cb{int(on)}": dict(shared_cb=on) for on in (True, False)}  # C B^T shared by the group's heads
    for name, config in configs.items():
        try:
            y, s = once(**config)
            res[name] = [bench_ms(lambda: step(**config), rep=30), rel_err(y, y_ref), rel_err(s, s_ref)]
        except Exception as e:  # a config that does not compile or run is reported, not fatal
            res[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, run and check every method once")
    ap.add_argument("--no-probe", action="store_true", help="skip the launch-config probe")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)

    def save(rows, probe):
        return write_results("mamba2_tree.json", rows, extra=dict(
            ceilings=ceil, accuracy=accuracy, configs=CONFIGS, probe=probe, wall_s=time.time() - t0))

    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    configs = SMOKE_CONFIGS if smoke else CONFIGS
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1")
        ceil = {"copy_bytes_per_s": 4.0e12, "bf16_flops_per_s": 8.0e14}  # placeholders: no timing on CPU
        timer = lambda fn, rep=60: (fn(), float("nan"))[1]  # noqa: E731
    else:
        ceil = device_ceilings()
        timer = bench_ms
    acc_Ns = (8, 16) if smoke else (8, 16, 32, 64, 128)
    accuracy = {}
    for name, cfg in configs.items():
        for dt in (torch.bfloat16, torch.float32):
            key = f"{name}/{str(dt).split('.')[-1]}"
            accuracy[key] = check_accuracy(cfg, dt, dev, Ns=acc_Ns)
            accuracy[key + "/baselines_N16"] = check_baselines(cfg, dt, dev)
            print("accuracy", key, {n: f"y {e[0]:.1e} state {e[1]:.1e}" for n, e in accuracy[key].items()},
                  {m: f"y {e[0]:.1e} state {e[1]:.1e}" for m, e in accuracy[key + "/baselines_N16"].items()}, flush=True)
    worst = max(e for errs in accuracy.values() for pair in errs.values() for e in pair)
    if not worst < 5e-2:
        if not smoke:
            save([], {})
        sys.exit(f"accuracy check failed: worst relative error {worst:.2e}")
    if smoke:
        Bs, Ns = (1, 3), (8, 16)
    elif args.quick:
        Bs, Ns = (1, 32), (16, 64)
    else:
        Bs, Ns = (1, 8, 32, 128), (8, 16, 32, 64, 128)
    rows = []
    for name, cfg in configs.items():
        H, G, P, Nst = cfg
        for B in Bs:
            for N in Ns:
                c = to_device(make_case(B, N, cfg, seed=1000 * B + N, dev=dev), dev)
                state = torch.randn(B, H, P, Nst, device=dev) * 0.1
                pending = PendingPath.empty(B, c["P"], H, G, P, Nst, dtype=torch.bfloat16, device=dev)
                m_mean = c["m_mean"]
                ours = timer(run_ours(c, state, pending))
                verify_only = timer(run_ours(c, state, pending, verify_only=True), rep=30)
                two_pass = timer(run_ours(c, state, pending, two_pass=True), rep=30)
                serial_fn, serial_tokens = serial_setup(c, state, cfg)
                serial = timer(serial_fn)
                del serial_fn
                pn_fn, pn_bytes = per_node_setup(c, state, cfg)
                per_node = timer(pn_fn)
                del pn_fn
                fl, bytes_, flops = floor_ms(B, N, m_mean, cfg, ceil)
                ours_transient = B * c["P"] * input_row_bytes(cfg, with_c=False)
                rows.append(dict(
                    config=name, B=B, N=N, ours_ms=ours, serial_ms=serial, per_node_ms=per_node, floor_ms=fl,
                    ours_transient_bytes=ours_transient, per_node_transient_bytes=pn_bytes,
                    ours_verify_only_ms=verify_only, ours_two_pass_ms=two_pass, floor_bytes=bytes_, floor_flops=flops,
                    mean_accepted_path=m_mean, max_depth=c["tree"].max_depth, serial_path_tokens=serial_tokens,
                    H=H, G=G, P=P, d_state=Nst,
                ))
                print(f"{name:18s} B={B:4d} N={N:4d} ours {ours:8.4f} ms (verify {verify_only:.4f}, 2-pass {two_pass:.4f}) "
                      f"serial {serial:8.4f} per_node {per_node:8.4f} floor {fl:.4f} | x floor {ours / fl:5.2f} "
                      f"serial/ours {serial / ours:6.1f} per_node/ours {per_node / ours:6.1f} "
                      f"mem {pn_bytes / ours_transient:7.1f}x", flush=True)
                del c, state, pending
                if not smoke:
                    save(rows, {})  # partial results survive a later failure
                    torch.cuda.empty_cache()
    print_summary(rows)
    if smoke:
        print(f"\nwall {time.time() - t0:.0f} s\nsmoke: every method ran and matched the oracle; nothing written")
        return
    probe = {}
    if not args.no_probe and time.time() - t0 < 270:
        save(rows, probe)  # the probe tries untested launch configs last: a crash there loses nothing
        for name, cfg in configs.items():
            probe[f"{name}/B32/N64"] = probe_configs(cfg, 32, 64, dev)
            print("probe", name, "B=32 N=64", probe[f"{name}/B32/N64"], flush=True)
            for B, N in ((32, 32), (1, 64)):  # one block; one request: the shared tiles' launch against their savings
                probe[f"{name}/B{B}/N{N}"] = probe_configs(cfg, B, N, dev, cb_only=True)
                print("probe", name, f"B={B} N={N}", probe[f"{name}/B{B}/N{N}"], flush=True)
            save(rows, probe)  # an outer timeout keeps the shapes probed so far
    print(f"\nwall {time.time() - t0:.0f} s")
    print("wrote", save(rows, probe))


if __name__ == "__main__":
    main()
