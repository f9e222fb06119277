"""Device probe: launch configs of the GDN tree kernels (csrc_triton.gdn_tree) at Qwen3-Next-80B
shapes, B = 32, bf16 inputs: for verification (block_r, block_v, num_warps, bf16 inverse) the
error vs float64 and the median time; for the commit of a 9-token pending path (block_v,
num_warps) the time. Each config runs in its own process so an illegal access does not end the probe.
    python benchmarks/device/probe_gdn_configs.py [N ...]
"""
import subprocess
import sys

CHILD = r"""
import sys, torch, triton
sys.path.insert(0, '.')
from csrc_triton.gdn_tree import gdn_commit, gdn_verify
from vllm_bole.gdn import PendingPath
from vllm_bole.testing.oracles import gdn_tree_reference, random_tree_batch
N, nw, br, bv, inv = (int(a) for a in sys.argv[1:6])
B, Hk, Hv, K, V, P = 32, 16, 32, 128, 128, 17
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
verify = lambda: gdn_verify(q, k, v, g, beta, tree, state, slots, K ** -0.5, True, block_r=br or None, block_v=bv,
                            num_warps=nw, inv_lowp=bool(inv))
def commit():
    pend.length.fill_(9)
    gdn_commit(state, slots, pend, True, block_v=bv, num_warps=nw)
o = verify(); torch.cuda.synchronize()
o_ref, _ = gdn_tree_reference(tree, q, k, v, g, beta, state)
err = float((o.double() - o_ref).norm() / o_ref.norm())
t = [triton.testing.do_bench_cudagraph(f, rep=40, return_mode='median') for f in (verify, commit)]
print(f'RESULT N={N} warps={nw} BR={br} BV={bv} inv_lowp={inv} err={err:.2e} verify={t[0]:.4f} commit={t[1]:.4f}')
"""

Ns = [int(x) for x in sys.argv[1:]] or [64, 128, 256]
for N in Ns:
    # rows per block: 0 = the default (one block up to 64 nodes); at 64 nodes also two and four blocks (smaller
    # tiles, fewer spills?); the bf16 inverse only (inv_lowp 1: as accurate and faster at 64 nodes, gdn_probe_configs_n64.log)
    for br in ((0, 32, 16) if N == 64 else (0,) if N < 64 else (32, 64)):
        for bv, nw in ((64, 4), (64, 8), (32, 4)):
            args = [str(N), str(nw), str(br), str(bv), "1"]
            r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=180)
            line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
            err = r.stderr.strip().splitlines()[-1][:160] if r.stderr.strip() else r.returncode
            print(line[0] if line else f"FAIL N={N} warps={nw} BR={br} BV={bv} inv_lowp=1: {err}", flush=True)
