"""Mamba1 tree verification on the GPU (issue 19): ours (stash + fused commit/verify step) against
serial, per-node and the floor; keys as ``mamba2_tree.json``.

Run on the H200 (about 3 minutes):
    python benchmarks/bench_mamba1_tree.py            # writes $OUT/mamba1_tree.json (or benchmarks/results/)
    python benchmarks/bench_mamba1_tree.py --quick    # a few shapes
    TRITON_INTERPRET=1 python benchmarks/bench_mamba1_tree.py --smoke   # CPU: tiny shapes, every method
                                                      # once and checked, no timing, no file

Shapes: the Mamba1 mixers of Jamba-1.5-Mini and Falcon-Mamba-7B (both hidden 4096, expand 2:
8192 channels, d_state 16) and their TP=2 shard (4096 channels). Per step and request every method
produces all tree outputs y (C . h + D x; the gate is left out, as it is elementwise) and leaves the
accepted node's state in the request's slot:
  ours      ``stash_accepted_path`` of the previous step's accepted path + one ``mamba1_tree_step``
            launch that commits it in place and verifies the new tree (extra: verify alone);
  serial    one Triton launch walking every root-to-leaf path token by token (program per path
            and channel tile, state from the slot), the accepted node's state to a scratch
            buffer, then copied into the slots;
  per_node  one Triton launch walking the nodes in topological order, every node's full state
            from its parent's written out (SGLang / vLLM style), + copy of the accepted one;
  floor     bytes / copy bandwidth (measured here): state read and written once, node inputs
            (x, dt, B, C) read and y written once, the accepted path stashed and read back. The
            recurrence's exponentials (T x channels x d_state, far below the SFU's rate) are not
            counted; the closed form forms up to depth + 1 of them per node and state element.
Trees, accepted paths and slots as the Mamba2 and GDN benchmarks (``benchmarks/tree_cases.py``).
Inputs x, dt, B, C bf16; A (S4D-real: -1..-d_state per channel), D, dt_bias fp32; state fp32.
Accuracy: ours and both baselines against the float64 oracle for bf16 and fp32 inputs, first.
"""
import argparse
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
from vllm_bole.mamba.mamba1_tree import PendingPath, mamba1_tree_step, stash_accepted_path  # noqa: E402
from vllm_bole.mamba.mamba1_tree.reference import mamba1_tree_reference  # noqa: E402

CONFIGS = {"jamba-mini/falcon-mamba-7b": (8192, 16), "tp2": (4096, 16)}  # channels Dn, d_state N
SMOKE_CONFIGS = {"tiny": (64, 16)}
BD = 64  # the baselines' channel tile


# ------------------------------------------------------------------------------- baselines
@triton.jit
def _token(S, x, dt, Bm, Cm, y, i, o_d, o_n, A_t, D_v, bias_v, Dn: tl.constexpr, N: tl.constexpr):
    """One selective-state update of the [BD, N] tile with node i (int64); writes y[i]; returns the state."""
    d = tl.load(dt + i * Dn + o_d).to(tl.float32) + bias_v
    d = tl.where(d <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    xv = tl.load(x + i * Dn + o_d).to(tl.float32)
    bv = tl.load(Bm + i * N + o_n).to(tl.float32)
    cv = tl.load(Cm + i * N + o_n).to(tl.float32)
    S = S * tl.exp(d[:, None] * A_t) + (d * xv)[:, None] * bv[None, :]
    tl.store(y + i * Dn + o_d, (tl.sum(S * cv[None, :], 1) + D_v * xv).to(y.dtype.element_ty))
    return S


@triton.jit
def _tile(A, D, dt_bias, dt_tile, Dn: tl.constexpr, N: tl.constexpr, BDc: tl.constexpr):
    o_d = dt_tile * BDc + tl.arange(0, BDc)
    o_n = tl.arange(0, N)
    return o_d, o_n, tl.load(A + o_d[:, None] * N + o_n[None, :]), tl.load(D + o_d), tl.load(dt_bias + o_d)


@triton.jit
def serial_kernel(x, dt, Bm, Cm, y, A, D, dt_bias, path_rows, path_cu, path_req, path_acc, state, state_idx, scratch,
                  Dn: tl.constexpr, N: tl.constexpr, BDc: tl.constexpr):
    """Program (root-to-leaf path, channel tile) walks its path token by token from the slot's
    state; the accepted node's state goes to scratch[request]."""
    pth, dtile = tl.program_id(0), tl.program_id(1)
    o_d, o_n, A_t, D_v, bias_v = _tile(A, D, dt_bias, dtile, Dn, N, BDc)
    r = tl.load(path_req + pth)
    slot = tl.load(state_idx + r).to(tl.int64)
    tile = o_d[:, None] * N + o_n[None, :]
    S = tl.load(state + slot * Dn * N + tile)
    start = tl.load(path_cu + pth)
    acc = tl.load(path_acc + pth)
    for t in range(start, tl.load(path_cu + pth + 1)):
        S = _token(S, x, dt, Bm, Cm, y, tl.load(path_rows + t).to(tl.int64), o_d, o_n, A_t, D_v, bias_v, Dn, N)
        if t - start == acc:
            tl.store(scratch + r.to(tl.int64) * Dn * N + tile, S)


@triton.jit
def per_node_kernel(x, dt, Bm, Cm, y, A, D, dt_bias, parent_flat, cu_nodes, states, state, state_idx,
                    Dn: tl.constexpr, N: tl.constexpr, BDc: tl.constexpr):
    """Program (request, channel tile): nodes in topological order, each node's full [BD, N]
    state from its parent's (or the slot's for the root), written to ``states`` [T, Dn, N]."""
    b, dtile = tl.program_id(0), tl.program_id(1)
    o_d, o_n, A_t, D_v, bias_v = _tile(A, D, dt_bias, dtile, Dn, N, BDc)
    tile = o_d[:, None] * N + o_n[None, :]
    S0 = tl.load(state + tl.load(state_idx + b).to(tl.int64) * Dn * N + tile)
    for i in range(tl.load(cu_nodes + b).to(tl.int64), tl.load(cu_nodes + b + 1).to(tl.int64)):
        p = tl.load(parent_flat + i)
        if p < 0:
            S = S0
        else:
            S = tl.load(states + p.to(tl.int64) * Dn * N + tile)
        S = _token(S, x, dt, Bm, Cm, y, i, o_d, o_n, A_t, D_v, bias_v, Dn, N)
        tl.store(states + i * Dn * N + tile, S)
        tl.debug_barrier()


# ------------------------------------------------------------------------------- cases, methods
def make_case(B, N, cfg, seed, dtype=torch.bfloat16, dev="cuda"):
    Dn, Nst = cfg
    tree, gen = seeded_trees(B, N, seed)
    T = tree.num_nodes
    x = torch.randn(T, Dn, generator=gen).to(dev, dtype)
    dt = (torch.randn(T, Dn, generator=gen) * 0.5).to(dev, dtype)
    Bm = (torch.randn(T, Nst, generator=gen) * 0.5).to(dev, dtype)
    Cm = (torch.randn(T, Nst, generator=gen) * 0.5).to(dev, dtype)
    A = -torch.arange(1, Nst + 1, dtype=torch.float32).repeat(Dn, 1).to(dev)  # S4D-real, as Mamba1's A_log init
    dt0 = torch.exp(torch.rand(Dn, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(dev)  # softplus^-1 of dt0 ~ logU[1e-3, 1e-1]
    D = torch.ones(Dn).to(dev)
    return finish_case(dict(x=x, dt=dt, Bm=Bm, Cm=Cm, A=A, D=D, dt_bias=dt_bias), tree, gen)


def _kw(c, kernels="triton"):
    return dict(D=c["D"], dt_bias=c["dt_bias"], dt_softplus=True, kernels=kernels)


def _args(c, tree=True):
    return (c["x"], c["dt"], c["A"], c["Bm"], c["Cm"], c["tree_dev"] if tree else None)


def run_ours(c, state, pending, verify_only=False):
    slots = c["slots_dev"]
    if verify_only:
        return lambda: mamba1_tree_step(*_args(c), state, slots, None, **_kw(c))

    def step():
        stash_accepted_path(pending, slots, c["tree_dev"], c["acc_dev"], c["x"], c["dt"], c["Bm"], kernels="triton")
        return mamba1_tree_step(*_args(c), state, slots, pending, reset_pending=False, **_kw(c))  # as the engine

    return step


def tile_sweep(c, state, timer):
    """Verification alone at other tile sizes and warp counts ({"tile/warps": ms}): the data for the
    launcher's defaults (``csrc_triton.mamba1_tree.TILE``, 4 warps)."""
    from csrc_triton.mamba1_tree import mamba1_tree_step as launch

    args = (*_args(c), state, c["slots_dev"], None, c["D"], None, c["dt_bias"], True)
    return {f"{t}/{w}": timer(lambda: launch(*args, tile=t, num_warps=w), rep=30)
            for t in (256, 512, 1024) for w in (1, 2, 4, 8)}


def groups_sweep(c, state, pending, timer):
    """The whole step (stash + commit + verify) with each request's leaves split over G programs
    ({G: ms}; G > 1 commits in its own launch first): the data for ``path_groups`` at small batches."""
    from csrc_triton.mamba1_tree import mamba1_tree_step as launch

    slots = c["slots_dev"]

    def step(G):
        stash_accepted_path(pending, slots, c["tree_dev"], c["acc_dev"], c["x"], c["dt"], c["Bm"], kernels="triton")
        return launch(*_args(c), state, slots, pending, c["D"], None, c["dt_bias"], True, path_groups=G)

    return {G: timer(lambda: step(G)) for G in (1, 2, 4, 8, 16)}


def serial_setup(c, state, cfg):
    Dn, Nst = cfg
    dev = state.device
    paths = root_to_leaf_paths(c["tree"], c["acc_node"])
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    rows, cu, req, acc_pos = i32(paths["rows"]), i32(paths["cu"]), i32(paths["req"]), i32(paths["acc_pos"])
    scratch = torch.empty(c["tree"].num_requests, Dn, Nst, device=dev, dtype=torch.float32)
    y = torch.empty_like(c["x"])
    slots = c["slots_dev"].long()

    def run():
        serial_kernel[(len(paths["req"]), Dn // BD)](
            c["x"], c["dt"], c["Bm"], c["Cm"], y, c["A"], c["D"], c["dt_bias"], rows, cu, req, acc_pos, state,
            c["slots_dev"], scratch, Dn=Dn, N=Nst, BDc=BD, num_warps=4)
        state.index_copy_(0, slots, scratch)
        return y

    return run, len(paths["rows"])


def per_node_setup(c, state, cfg):
    Dn, Nst = cfg
    tree = c["tree_dev"]
    states = torch.empty(tree.num_nodes, Dn, Nst, device=state.device, dtype=torch.float32)
    y = torch.empty_like(c["x"])
    pflat = tree.parent_flat.to(torch.int32)
    acc_flat = accepted_flat(tree, c["acc_node"], state.device)
    slots = c["slots_dev"].long()

    def run():
        per_node_kernel[(tree.num_requests, Dn // BD)](
            c["x"], c["dt"], c["Bm"], c["Cm"], y, c["A"], c["D"], c["dt_bias"], pflat, tree.cu_nodes, states, state,
            c["slots_dev"], Dn=Dn, N=Nst, BDc=BD, num_warps=4)
        state[slots] = states[acc_flat]
        return y

    return run, states.numel() * 4


def input_row_bytes(cfg, with_c=True):
    """Bytes of one node's bf16 inputs (x, dt, B and optionally C)."""
    Dn, Nst = cfg
    return 2 * Dn * 2 + Nst * 2 * (2 if with_c else 1)


def floor_ms(B, N, m_mean, cfg, ceil):
    Dn, Nst = cfg
    T = B * N
    bytes_ = 2 * B * Dn * Nst * 4 + T * (input_row_bytes(cfg) + Dn * 2) + 2 * B * m_mean * input_row_bytes(cfg, False)
    return bytes_ / ceil["copy_bytes_per_s"] * 1e3, bytes_



def _oracle(c, state):
    kw = _kw(c)
    kw.pop("kernels")
    y_ref, st_ref = mamba1_tree_reference(c["tree_dev"], c["x"], c["dt"], c["A"], c["Bm"], c["Cm"],
                                          state[c["slots_dev"].long()], **kw)
    return y_ref, st_ref[accepted_flat(c["tree"], c["acc_node"], state.device)]


def check_accuracy(cfg, dtype, dev, Ns, B=4, seed=0):
    """ours against the float64 oracle for every tree size: outputs, and the state after the stash
    + commit of the accepted path (the oracle's state at the accepted node)."""
    Dn, Nst = cfg
    out = {}
    for N in Ns:
        c = to_device(make_case(B, N, cfg, seed + N, dtype, dev), dev)
        slots = c["slots_dev"]
        state = torch.randn(B, Dn, Nst, device=dev)
        y_ref, want = _oracle(c, state)
        y = mamba1_tree_step(*_args(c), state, slots, None, **_kw(c))
        pending = PendingPath.empty(B, c["P"], Dn, Nst, dtype=dtype, device=dev)
        stash_accepted_path(pending, slots, c["tree_dev"], c["acc_dev"], c["x"], c["dt"], c["Bm"], kernels="triton")
        mamba1_tree_step(None, None, c["A"], None, None, None, state, slots, pending, **_kw(c))
        out[N] = (rel_err(y, y_ref), rel_err(state[slots.long()], want))
    return out


def check_baselines(cfg, dtype, dev, B=3, N=16, seed=5):
    """serial and per_node against the oracle: all outputs and the accepted states in the slots."""
    Dn, Nst = cfg
    c = to_device(make_case(B, N, cfg, seed, dtype, dev), dev)
    state = torch.randn(B, Dn, Nst, device=dev)
    y_ref, want = _oracle(c, state)
    return baseline_errors(c, state, cfg, dict(serial=serial_setup, per_node=per_node_setup), y_ref, want)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, every method once")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    configs = SMOKE_CONFIGS if smoke else CONFIGS
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1")
        ceil = {"copy_bytes_per_s": 4.0e12}  # a placeholder: no timing on CPU
        timer = lambda fn, rep=60: (fn(), float("nan"))[1]  # noqa: E731
    else:
        ceil = device_ceilings()
        timer = bench_ms

    def save(rows):
        return write_results("mamba1_tree.json", rows, extra=dict(ceilings=ceil, accuracy=accuracy, configs=CONFIGS,
                                                                   wall_s=time.time() - t0))

    accuracy = {}
    for name, cfg in configs.items():
        for dt in (torch.bfloat16, torch.float32):
            key = f"{name}/{str(dt).split('.')[-1]}"
            accuracy[key] = check_accuracy(cfg, dt, dev, Ns=(8, 16) if smoke else (8, 16, 32, 64, 128))
            accuracy[key + "/baselines_N16"] = check_baselines(cfg, dt, dev)
            print("accuracy", key, {n: f"y {e[0]:.1e} state {e[1]:.1e}" for n, e in accuracy[key].items()},
                  {m: f"y {e[0]:.1e} state {e[1]:.1e}" for m, e in accuracy[key + "/baselines_N16"].items()}, flush=True)
    worst = max(e for errs in accuracy.values() for pair in errs.values() for e in pair)
    if not worst < 5e-2:
        if not smoke:
            save([])
        sys.exit(f"accuracy check failed: worst relative error {worst:.2e}")
    Bs, Ns = ((1, 3), (8, 16)) if smoke else ((1, 32), (16, 64)) if args.quick else ((1, 8, 32, 128), (8, 16, 32, 64, 128))
    rows = []
    for name, cfg in configs.items():
        Dn, Nst = cfg
        for B in Bs:
            for N in Ns:
                c = to_device(make_case(B, N, cfg, seed=1000 * B + N, dev=dev), dev)
                state = torch.randn(B, Dn, Nst, device=dev) * 0.1
                pending = PendingPath.empty(B, c["P"], Dn, Nst, dtype=torch.bfloat16, device=dev)
                ours = timer(run_ours(c, state, pending))
                verify_only = timer(run_ours(c, state, pending, verify_only=True), rep=30)
                serial_fn, serial_tokens = serial_setup(c, state, cfg)
                serial = timer(serial_fn)
                pn_fn, pn_bytes = per_node_setup(c, state, cfg)
                per_node = timer(pn_fn)
                del serial_fn, pn_fn
                fl, bytes_ = floor_ms(B, N, c["m_mean"], cfg, ceil)
                ours_transient = B * c["P"] * input_row_bytes(cfg, with_c=False)
                tiles = tile_sweep(c, state, timer) if (B, N) == (32, 64) and not smoke else {}
                groups = groups_sweep(c, state, pending, timer) if B <= 8 else {}
                rows.append(dict(
                    config=name, B=B, N=N, ours_ms=ours, ours_verify_tiles_ms=tiles, ours_path_groups_ms=groups, serial_ms=serial, per_node_ms=per_node, floor_ms=fl,
                    ours_transient_bytes=ours_transient, per_node_transient_bytes=pn_bytes,
                    ours_verify_only_ms=verify_only, floor_bytes=bytes_, mean_accepted_path=c["m_mean"],
                    max_depth=c["tree"].max_depth, serial_path_tokens=serial_tokens, channels=Dn, d_state=Nst))
                print(f"{name:26s} B={B:4d} N={N:4d} ours {ours:8.4f} ms (verify {verify_only:.4f}) serial {serial:8.4f} "
                      f"per_node {per_node:8.4f} floor {fl:.4f} | x floor {ours / fl:5.2f} serial/ours "
                      f"{serial / ours:6.1f} per_node/ours {per_node / ours:6.1f}", flush=True)
                del c, state, pending
                if not smoke:
                    save(rows)  # partial results survive a later failure
                    torch.cuda.empty_cache()
    print_summary(rows)
    if smoke:
        print(f"\nwall {time.time() - t0:.0f} s\nsmoke: every method ran and matched the oracle; nothing written")
        return
    print(f"\nwall {time.time() - t0:.0f} s\nwrote", save(rows))


if __name__ == "__main__":
    main()
