"""Device probe: launch configs of the GDN tree kernel (block_v, num_warps, bf16 operands, bf16
inverse) at Qwen3-Next-80B shapes, B = 32, bf16 inputs: error vs float64 and median time of
verify alone, the fused step (commit of a 9-token pending path + verify) and the commit alone.
Each config runs in its own process so an illegal access does not end the probe.
    python benchmarks/device/probe_gdn_configs.py [N ...]
"""
import subprocess
import sys

CHILD = r"""
import sys, torch, triton
sys.path.insert(0, '.')
from csrc_triton.gdn_tree import gdn_tree_step
from vllm_bole.mamba.gdn_tree import PendingPath
from vllm_bole.testing.oracles import gdn_tree_reference, random_tree_batch
N, nw, lowp, bv, inv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1', int(sys.argv[4]), sys.argv[5] == '1'
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
kw = dict(block_v=bv, num_warps=nw, lowp=lowp, inv_lowp=inv)
verify = lambda: gdn_tree_step(q, k, v, g, beta, tree, state, slots, None, K ** -0.5, True, **kw)
def fused():
    pend.length.fill_(9)
    return gdn_tree_step(q, k, v, g, beta, tree, state, slots, pend, K ** -0.5, True, **kw)
def commit():
    pend.length.fill_(9)
    return gdn_tree_step(None, None, None, None, None, None, state, slots, pend, K ** -0.5, True, **kw)
o = verify(); torch.cuda.synchronize()
o_ref, _ = gdn_tree_reference(tree, q, k, v, g, beta, state)
err = float((o.double() - o_ref).norm() / o_ref.norm())
t = [triton.testing.do_bench_cudagraph(f, rep=40, return_mode='median') for f in (verify, fused, commit)]
print(f'RESULT N={N} warps={nw} lowp={int(lowp)} BV={bv} inv_lowp={int(inv)} err={err:.2e} verify={t[0]:.4f} fused={t[1]:.4f} commit={t[2]:.4f} two_pass={t[0] + t[2]:.4f}')
"""

Ns = [int(x) for x in sys.argv[1:]] or [64]
for N in Ns:
    for bv, nw in ((64, 4), (64, 8), (128, 8), (128, 16)):
        for inv in ("0", "1"):
            args = [str(N), str(nw), "1", str(bv), inv]
            r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=180)
            line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
            err = r.stderr.strip().splitlines()[-1][:160] if r.stderr.strip() else r.returncode
            print(line[0] if line else f"FAIL N={N} warps={nw} BV={bv} inv_lowp={inv}: {err}", flush=True)
