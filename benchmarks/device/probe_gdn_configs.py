"""Device probe: which (num_warps, lowp, block_v) launch configs of the GDN tree kernel run and are
correct at each tree size, and how fast (B = 32, Qwen3-Next-80B shapes). Each config runs in its
own process so one illegal access does not end the probe."""
import subprocess
import sys

CHILD = r"""
import sys, torch, triton
sys.path.insert(0, '.')
from csrc_triton.gdn_tree import gdn_tree_step
from vllm_bole.testing.oracles import gdn_tree_reference, random_tree_batch
N, nw, lowp, bv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1', int(sys.argv[4])
B, Hk, Hv, K, V = 32, 16, 32, 128, 128
gen = torch.Generator().manual_seed(N)
tree = random_tree_batch([N] * B, max_depth=16, generator=gen).to('cuda')
T = tree.num_nodes
q, k = (torch.randn(T, Hk, K, generator=gen).cuda().bfloat16() for _ in range(2))
v = torch.randn(T, Hv, V, generator=gen).cuda().bfloat16()
g, beta = -torch.rand(T, Hv).cuda() * 0.3, torch.rand(T, Hv).cuda()
state = torch.randn(B, Hv, K, V, device='cuda') * 0.1
slots = torch.arange(B, device='cuda', dtype=torch.int32)
f = lambda: gdn_tree_step(q, k, v, g, beta, tree, state, slots, None, K ** -0.5, True, block_v=bv, num_warps=nw, lowp=lowp)
o = f(); torch.cuda.synchronize()
o_ref, _ = gdn_tree_reference(tree, q, k, v, g, beta, state)
err = float((o.double() - o_ref).norm() / o_ref.norm())
ms = triton.testing.do_bench_cudagraph(f, rep=50, return_mode='median')
print(f'RESULT N={N} warps={nw} lowp={int(lowp)} BV={bv} err={err:.2e} ms={ms:.4f}')
"""

for N in (16, 32, 64, 128):
    for nw in (4, 8):
        for lowp in ("0", "1"):
            for bv in (32, 64):
                if N >= 128 and lowp == "0":
                    continue
                r = subprocess.run([sys.executable, "-c", CHILD, str(N), str(nw), lowp, str(bv)], capture_output=True, text=True, timeout=120)
                line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
                print(line[0] if line else f"FAIL N={N} warps={nw} lowp={lowp} BV={bv}: {r.stderr.strip().splitlines()[-1][:150] if r.stderr.strip() else r.returncode}", flush=True)
