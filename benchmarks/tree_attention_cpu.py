"""``bench_tree_attention.py --cpu-check``: tiny shapes on CPU, fp32: the torch path (and Triton
under TRITON_INTERPRET=1), per-branch and SDPA baselines against the float64 reference,
counting, JSON writing (to a temporary folder), the compaction against the autoregressive cache.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

from benchmarks import bench_tree_attention as bench
from vllm_bole.attention import accepted_path, compact_accepted_kv


def cpu_check():
    """Tiny shapes on CPU, fp32: the torch path (and Triton under TRITON_INTERPRET=1), per-branch
    and SDPA baselines against the float64 reference, counting, JSON writing."""
    device, dtype = torch.device("cpu"), torch.float32
    bench.HQ, bench.HKV, bench.HEAD_DIM = 16, 2, 32  # Qwen3-Next's group of 8, small head dim
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    choices = ["torch"] + (["triton"] if interp else [])
    checks = []
    for kernels in choices:
        for (B, N, P) in ((3, 16, 37), (2, 9, 0), (1, 24, 64)):
            res = bench.check_case(B, N, P, 7, device, dtype, 1e-5, kernels=kernels)
            res["kernels"] = kernels
            checks.append(res)
            print("check", json.dumps(res), flush=True)
    comp = check_compaction_cpu()
    print("check", json.dumps(comp))
    ok = all(ch[k]["ok"] for ch in checks for k in ("ours", "ours_split4", "per_branch", "sdpa"))
    ok = ok and comp["compaction_equal"]
    ceil = {"copy_bytes_per_s": 4.24e12, "bf16_flops_per_s": 793e12}  # the H200's, from the brief
    rows = [bench.time_row(B, N, P, 5, ceil, bench.cpu_timer, device, dtype) for (B, N, P) in ((2, 16, 48), (1, 8, 100))]
    floor_target = bench.target_floor(ceil)
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_tree_attention_")
    path = os.path.join(out_dir, "tree_attention_cpu_check.json")
    with open(path, "w") as f:
        json.dump({"device": "cpu", "torch": torch.__version__, "checks": checks, "compaction": comp, "rows": rows,
                   "target_floor_h200": floor_target}, f, indent=1, default=str)
    bench.print_table(rows)
    print(f"\nexpected floor at the target shape on the H200 (brief's ceilings): {json.dumps(floor_target)}")
    print(f"cpu check {'passed' if ok else 'FAILED'}; wrote {path}")
    return 0 if ok else 1


def check_compaction_cpu():
    """Compaction (Triton under TRITON_INTERPRET=1, else torch) against the autoregressive cache."""
    c = bench.make_case(4, 24, 37, 3, torch.device("cpu"), torch.float32, hq=bench.HQ, hkv=bench.HKV, d=bench.HEAD_DIM)
    tree = c["tree_cpu"]
    cu = tree.cu_nodes.tolist()
    last = torch.tensor([int(tree.depth[s:e].argmax()) for s, e in zip(cu[:-1], cu[1:])])
    acc = accepted_path(tree, last)
    bufs = torch.randn(3, *c["raw"].shape)  # 3 layers, vLLM 0.33 layout each
    orig = bufs.clone()
    ref = bufs.clone()
    kernels = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    compact_accepted_kv([x.unbind(1)[0] for x in bufs], [x.unbind(1)[1] for x in bufs], c["bt"], c["prefix"], acc,
                        kernels=kernels)
    P, page, bt = c["P"], c["page"], c["bt_cpu"]
    moved = 0
    for b in range(c["B"]):
        for j, node in enumerate(x for x in acc[b].tolist() if x >= 0):
            d_pos, s_pos = P + j, P + node
            ref[:, int(bt[b, d_pos // page]), :, d_pos % page] = orig[:, int(bt[b, s_pos // page]), :, s_pos % page]
            moved += node != j
    return {"compaction_equal": bool(torch.equal(bufs, ref)), "kernels": kernels, "rows_moved": moved}
