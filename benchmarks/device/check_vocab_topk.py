"""The draft's top-k with softmax probabilities on the H200: the two-launch Triton kernel against its
torch twin (``vocab_topk_torch``: top-k, casts, log-sum-exp, ~8 launches), each timed inside a CUDA graph
(as the draft's step graph runs it) at the pair's draft shapes (49152-token vocabulary, bf16 logits, top-8)
and batch 1..256; tokens equal to the float64 reference (ties to the lower id), probabilities within
2e-6 relative. Writes ``vocab_topk.json``: ``equal`` and ``rows`` (keys ``batch, vocab, top_k, dtype,
twin_us, kernel_us, speedup, equal``).

    python3 benchmarks/device/check_vocab_topk.py
    TRITON_INTERPRET=1 python3 benchmarks/device/check_vocab_topk.py   # CPU: equality only (a dry run)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import bench_graph_ms, write_results  # noqa: E402

from vllm_bole.spec_decode.vocab_topk import vocab_topk, vocab_topk_reference  # noqa: E402


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for B in (1, 8, 32, 128, 256) if dev == "cuda" else (1, 3):
            V, K = 49152, 8
            x = (torch.randn(B, V, generator=g) * 3).to(dtype).to(dev)
            p, t = vocab_topk(x, K, kernels="triton")
            rp, rt = vocab_topk_reference(x.cpu(), K)
            same = bool(torch.equal(t.cpu(), rt)) and bool(torch.allclose(p.cpu().double(), rp, rtol=2e-6, atol=1e-9))
            row = dict(batch=B, vocab=V, top_k=K, dtype=str(dtype).split(".")[-1], equal=same)
            if dev == "cuda":
                ms = {k: bench_graph_ms(lambda k=k: vocab_topk(x, K, kernels=k)) for k in ("torch", "triton")}
                row.update(twin_us=round(ms["torch"] * 1e3, 1), kernel_us=round(ms["triton"] * 1e3, 1),
                           speedup=round(ms["torch"] / ms["triton"], 2))
            rows.append(row)
            print(row, flush=True)
    write_results("vocab_topk.json", rows, dict(equal=all(r["equal"] for r in rows)))


if __name__ == "__main__":
    main()
