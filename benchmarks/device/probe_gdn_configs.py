"""Device probe: launch configs of the GDN tree step (csrc_triton.gdn_tree.gdn_step) at Qwen3-Next-80B shapes
(Hk 16, Hv 32, K = V = 128), bf16 inputs, fp32 state, a 5-token pending path per request, as the engine runs a
step. Per (B, N): one launch (commit and verification together) against two (commit alone, then
verification alone: the launcher's choice for blocked trees since fbec640's probe), with V tiles of
32 or 64 columns, V splits 1 (one program per request and head, V looped), ``v_splits``' and one
program per tile, 4 or 8 warps (two launches: 4), and for trees of 33-64 nodes fp32 operands in one 64-row block
(``lowp`` false; the default's bf16 operands take two blocks of 32); the median time of each (CUDA graph), the
launcher's default config (``default``), and the output's error against the float64 oracle. Each (B, N) runs in its own
process (an illegal access ends only its row). Writes ``gdn_probe_configs.json`` (``rows``: ``B, N, launches,
block_v, v_split, warps, lowp, ms, err, default``) where ``harness.write_results`` puts results.
    python benchmarks/device/probe_gdn_configs.py [--batches 1 8 32 128] [--nodes 16 64 128]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = r"""
import json, sys, torch, triton
sys.path.insert(0, '.')
from csrc_triton.gdn_tree import block_rows, default_lowp, gdn_step, launch_config, v_splits
from vllm_bole.gdn import PendingPath
from vllm_bole.testing.oracles import gdn_tree_reference, random_tree_batch
B, N = int(sys.argv[1]), int(sys.argv[2])
Hk, Hv, K, V, P, m = 16, 32, 128, 128, 17, 5
gen = torch.Generator().manual_seed(N)
tree = random_tree_batch([N] * B, max_depth=16, generator=gen).to('cuda')
T = tree.num_nodes
q, k = (torch.randn(T, Hk, K, generator=gen).cuda().bfloat16() for _ in range(2))
v = torch.randn(T, Hv, V, generator=gen).cuda().bfloat16()
g, beta = -torch.rand(T, Hv).cuda() * 0.3, torch.rand(T, Hv).cuda()
state = torch.randn(B, Hv, K, V, device='cuda') * 0.1
slots = torch.arange(B, device='cuda', dtype=torch.int32)
pend = PendingPath.empty(B, P, Hk, Hv, K, V, dtype=torch.bfloat16, device='cuda')
pend.k.normal_(); pend.v.normal_(); pend.g.uniform_(-0.3, 0); pend.beta.uniform_(0, 1)
out = torch.empty(T, Hv, V, dtype=torch.bfloat16, device='cuda')
o_ref, _ = gdn_tree_reference(tree, q, k, v, g, beta, state)

def step(launches, **cfg):
    def run():
        pend.length.fill_(m)  # as the engine's stash before each step
        if launches == 1:
            gdn_step(q, k, v, g, beta, tree, state, slots, K ** -0.5, True, pend, slots, out, launches=1, **cfg)
        else:
            gdn_step(None, None, None, None, None, None, state, slots, K ** -0.5, True, pend, slots, **cfg)
            gdn_step(q, k, v, g, beta, tree, state, slots, K ** -0.5, True, None, None, out, **cfg)
    return run

default_bv, default_nv = launch_config(B, Hv, V, state.device)
default_lowp_ = default_lowp(N, K, True)
default_launches = 2 if block_rows(N, K, default_lowp_)[1] else 1  # blocked trees: commit and verification apart
configs = []  # (launches, block_v, v_split, warps, lowp): two launches at 4 warps only
for bv in (32, 64):
    for nv in sorted({1, v_splits(B * Hv, V // bv, state.device), V // bv}):
        configs += [(1, bv, nv, 4, True), (1, bv, nv, 8, True), (2, bv, nv, 4, True)]
        # fp32 operands: trees of 33-64 nodes then run as ONE block of 64 rows in one launch (bf16 operands
        # take two blocks of 32, a 64-row bf16 block having faulted on the H100)
        configs += [(1, bv, nv, 4, False)] if block_rows(N, K, True)[1] and not block_rows(N, K, False)[1] else []
for launches, bv, nv, nw, lowp in configs:
    row = dict(B=B, N=N, launches=launches, block_v=bv, v_split=nv, warps=nw, lowp=lowp,
               default=(launches, bv, nv, nw, lowp) == (default_launches, default_bv, default_nv, 4, default_lowp_))
    cfg = dict(v_split=nv, num_warps=nw, block_v=bv, lowp=lowp)
    try:
        gdn_step(q, k, v, g, beta, tree, state.clone(), slots, K ** -0.5, True, None, None, out, **cfg)
        torch.cuda.synchronize()
        row['err'] = float((out.double() - o_ref).norm() / o_ref.norm())
        saved = state.clone()
        row['ms'] = triton.testing.do_bench_cudagraph(step(launches, **cfg), rep=40, return_mode='median')
        state.copy_(saved)
    except Exception as e:  # noqa: BLE001 - a config that does not launch is a result
        row['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ""}'
    print('ROW ' + json.dumps(row), flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 1, 128, 8])  # the B = 32 first
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 16, 128])  # 128: blocks of 32 rows
    args = ap.parse_args()
    from benchmarks.harness import write_results

    rows = []
    for B in args.batches:
        for N in args.nodes:
            r = subprocess.run([sys.executable, "-c", CHILD, str(B), str(N)], capture_output=True, text=True, timeout=240)
            got = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ROW ")]
            if not got:
                err = r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else f"exit {r.returncode}"
                got = [dict(B=B, N=N, error=err)]
            for row in got:
                print(row, flush=True)
            rows += got  # written after every (B, N): an outer timeout keeps the rows measured so far
            path = write_results("gdn_probe_configs.json", rows,
                                 extra=dict(shapes=dict(Hk=16, Hv=32, K=128, V=128, pending=5)))
    print(path)


if __name__ == "__main__":
    main()
