"""Device probe: launch configs (block_v, num_warps) of the GDN commit-only launch (``tree=None``,
the first of the default two launches) at Qwen3-Next-80B shapes: median time against the state's
read + write at the measured copy bandwidth, and agreement with the default config.
    python benchmarks/device/probe_gdn_commit.py
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from csrc_triton.gdn_tree import gdn_tree_step  # noqa: E402
from vllm_bole.mamba.gdn_tree import PendingPath  # noqa: E402

Hk, Hv, K, V, P = 16, 32, 128, 128, 17
x = torch.empty(2 ** 28, dtype=torch.uint8, device="cuda")
bw = 2 * x.numel() / triton.testing.do_bench(lambda: x.clone(), rep=50, return_mode="median") / 1e9  # TB/s
print(f"copy bandwidth {bw:.2f} TB/s")
for B in (8, 32, 128):
    for m in (3, 5, 9):
        state0 = torch.randn(B, Hv, K, V, device="cuda") * 0.1
        slots = torch.arange(B, device="cuda", dtype=torch.int32)
        pend = PendingPath.empty(B, P, Hk, Hv, K, V, dtype=torch.bfloat16, device="cuda")
        pend.k.normal_(); pend.v.normal_(); pend.g.uniform_(-0.3, 0); pend.beta.uniform_(0, 1)
        floor = 2 * state0.numel() * 4 / bw / 1e9  # ms
        ref = None
        for bv, nw in ((64, 4), (64, 2), (32, 2), (32, 4), (32, 1), (16, 1), (16, 2), (128, 4)):
            state = state0.clone()

            def commit():
                pend.length.fill_(m)
                gdn_tree_step(None, None, None, None, None, None, state, slots, pend, K ** -0.5, True,
                              block_v=bv, num_warps=nw)

            try:
                state.copy_(state0)
                commit()
                torch.cuda.synchronize()
                out = state.clone()
                ref = out if ref is None else ref
                err = float((out - ref).norm() / ref.norm())
                t = triton.testing.do_bench_cudagraph(commit, rep=40, return_mode="median")
                print(f"RESULT B={B} m={m} BV={bv} warps={nw} commit={t:.4f} ms floor={floor:.4f} x{t / floor:.2f} "
                      f"diff_vs_default={err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects: report and go on
                print(f"FAIL B={B} m={m} BV={bv} warps={nw}: {str(e)[:120]}", flush=True)
