"""Compile the tree kernels for sm_90 on a machine without a GPU and report their shared memory,
registers and spills (Triton's compile metadata; ``ptxas -v`` on the PTX), for the launch configs
the launchers pick over the envelope (issue 14: the H200 allows 232448 bytes of shared memory
per block). Run WITHOUT TRITON_INTERPRET:
    python benchmarks/device/probe_kernel_smem.py [gdn] [ssd] [attention]
The Triton on the CPU machines (3.9) is not the H200's (3.6): this catches configs that cannot
fit; the device check (check_kernels_envelope.py) is the word on what launches there. The
kernels of 520a61a (before the envelope work) compile here to shared memory and registers close
to the current single-block ones (tree attention: identical), so the numbers are comparable.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SMEM_LIMIT = 232448
TARGET = GPUTarget("cuda", 90, 32)


def compile_stats(fn, sig: dict, constexprs: dict, num_warps=4, num_stages=1) -> dict:
    sig = {**sig, **{k: "constexpr" for k in constexprs}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    out = dict(shared=k.metadata.shared, ok=k.metadata.shared <= SMEM_LIMIT)
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                           capture_output=True, text=True, timeout=300)
        m = re.search(r"Used (\d+) registers", r.stderr)
        s = re.search(r"(\d+) bytes spill stores", r.stderr)
        out.update(regs=int(m.group(1)) if m else None, spill_bytes=int(s.group(1)) if s else None)
    finally:
        os.unlink(f.name)
    return out


def gdn_cases():
    from csrc_triton import gdn_tree as G

    for dt in ("fp32", "bf16"):
        for K, V in ((64, 64), (128, 128), (256, 256), (128, 96)):
            for BT in (64, 128, 256):
                BR, multi = G.block_rows(BT, K, dt == "bf16")
                for BV in sorted({G._pow2_divisor(V, bv) for bv in G.BLOCK_V}):
                    for NV in sorted({1, V // BV}):
                        sig = dict(q=f"*{dt}", k=f"*{dt}", v=f"*{dt}", g="*fp32", beta="*fp32", o=f"*{dt}",
                                   dscr="*fp32", gscr="*fp32", cu_nodes="*i32", anc_mask="*i32", inv_steps="i32",
                                   T="i32", state=f"*{dt}", state_idx="*i32", s_slot="i64", s_h="i64", s_k="i64",
                                   s_v="i64", pk=f"*{dt}", pv=f"*{dt}", pg="*fp32", pbeta="*fp32", plen="*i32",
                                   pidx="*i32", P="i32", scale="fp32")
                        ce = dict(Hk=1, Hv=2, K=K, V=V, BR=BR, BV=BV, NV=NV, MW=8, CP=16, STEPS=3, MULTI=multi,
                                  HAS_TREE=True, HAS_PENDING=not multi, USE_L2NORM=True, LOWP=dt == "bf16", EMUL=False,
                                  INV_LOWP=dt == "bf16")  # blocked trees: the commit in a launch of its own
                        yield (f"gdn_step {dt} K={K} V={V} BT={BT} BR={BR} BV={BV} NV={NV}", G.gdn_step_kernel, sig,
                               ce, 4)


def ssd_cases():
    from csrc_triton import ssd_tree as S

    for dt in ("fp32", "bf16"):
        for P, N in ((64, 128), (128, 256), (32, 16), (128, 128)):
            BN = max(16, triton.next_power_of_2(N))
            for BT in (32, 64, 128, 256):
                BP = min(32 if BN > 128 else 64, triton.next_power_of_2(P))
                BR = min(BT, 32)  # as ssd_tree_step
                multi = BT > BR
                sig = dict(x=f"*{dt}", dt=f"*{dt}", Bm=f"*{dt}", Cm=f"*{dt}", y=f"*{dt}", gscr="*fp32", cb="*fp32",
                           npair="i32", cu_nodes="*i32", anc_mask="*i32", T="i32", A="*fp32", D="*fp32",
                           dt_bias="*fp32", dt_lo="fp32", dt_hi="fp32", state=f"*{dt}", state_idx="*i32", s_slot="i64",
                           s_h="i64", s_p="i64", s_n="i64", px=f"*{dt}", pdt=f"*{dt}", pB=f"*{dt}", plen="*i32",
                           pidx="*i32", L="i32")
                ce = dict(H=8, G=8, P=P, N=N, BR=BR, BP=BP, BN=BN, CP=32, MW=8, MULTI=multi, HAS_CB=multi,
                          HAS_TREE=True, HAS_PENDING=True, HAS_D=True, HAS_DT_BIAS=True, DT_SOFTPLUS=True,
                          LOWP=dt == "bf16", BF16_EMUL=False, EVEN=P % BP == 0 and BN == N)
                yield (f"ssd_step {dt} P={P} N={N} BT={BT} BR={BR} BP={BP}", S.ssd_tree_step_kernel, sig, ce,
                       8 if multi and BN > 128 else 4)
            sig = dict(Bm=f"*{dt}", Cm=f"*{dt}", cb="*fp32", cu_nodes="*i32", npair="i32")
            yield (f"ssd_cb {dt} N={N} BR=32", S.ssd_cb_kernel, sig,
                   dict(G=8, N=N, BR=32, BN=BN, LOWP=dt == "bf16", EMUL=False), 4)


def attention_cases():
    from csrc_triton import tree_attention as A

    for dt in ("bf16", "fp32"):
        cfgs = list(A.GPU_TILES) if dt == "bf16" else [(16, 16, 4, 1, False)]
        for bm, bn, w, st, swap in cfgs:
            sig = dict(Q=f"*{dt}", K_cache=f"*{dt}", V_cache=f"*{dt}", Out=f"*{dt}", Block_table="*i32",
                       Prefix_len="*i32", Cu_nodes="*i32", Num_keys="*i32", Anc_mask="*i32", Part_acc="*fp32", Part_ml="*fp32",
                       Pre_out=f"*{dt}", Pre_lse="*fp32", qk_scale="fp32", num_kv_heads="i32", split_keys="i32",
                       **{f"stride_{n}": "i64" for n in ("qt", "qh", "ot", "oh", "kb", "ks", "kh", "vb", "vs", "vh",
                                                        "bt", "anc", "ps", "pt", "ph", "ms", "mt", "mh", "lh", "lt")})
            for pre in (False, True):  # True: the prefix's softmax from FlashAttention, the tree's keys here
                ce = dict(PAGE_SIZE=16, G=8, G_PAD=8, HEAD_DIM=256, HEAD_PAD=256, SPLIT=False, IEEE=dt == "fp32",
                          BLOCK_M=bm, BLOCK_N=bn, SWAP=swap, HAS_NUM_KEYS=False, PREFIX_IN=pre)
                yield (f"tree_attention {dt} D=256 BM={bm} BN={bn} w={w} st={st} swap={swap} prefix_in={pre}",
                       A._tree_attn_fwd, sig, ce, w, st)


def main():
    rows = []
    only = set(sys.argv[1:])  # kernel families to compile (gdn, ssd, attention), default all
    for gen in (gdn_cases, ssd_cases, attention_cases):
        if only and gen.__name__.removesuffix("_cases") not in only:
            continue
        for name, fn, sig, ce, *launch in gen():
            try:
                r = compile_stats(fn, sig, ce, *launch)
            except Exception as e:  # noqa: BLE001 - report and go on
                r = dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            rows.append((name, r))
            print(f"{name:60s} {r}", flush=True)
    bad = [n for n, r in rows if not r.get("ok")]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} fit in {SMEM_LIMIT} bytes of shared memory" + (f"; over: {bad}" if bad else ""))


if __name__ == "__main__":
    main()
