"""The paged draft's best-first search on the H200: the one-launch Triton kernel against its torch
twin (``level_search_packed``), equal trees over ``search_cases`` and the time of each inside a
CUDA graph (as the draft's step graph runs it) at the e2e engines' shapes (budget 16 and 64, top-8
candidates, depth 8) and batch 1..128. Writes ``level_search.json``: ``equal`` and ``rows`` (keys
``batch, slots, top_k, depth, twin_us, kernel_us, speedup``).

    python3 benchmarks/device/check_level_search.py
    TRITON_INTERPRET=1 python3 benchmarks/device/check_level_search.py   # CPU: equality only (a dry run)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import bench_graph_ms, write_results  # noqa: E402

from vllm_bole.spec_decode.best_first import level_search_packed  # noqa: E402
from vllm_bole.spec_decode.tree import MAX_DEPTH  # noqa: E402
from vllm_bole.testing.oracles import search_cases  # noqa: E402


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    equal = []
    for case in search_cases(torch.Generator().manual_seed(31), dev):
        a = level_search_packed(*case, kernels="torch")
        b = level_search_packed(*case, kernels="triton")
        equal.append(bool(torch.equal(a, b)))
    print(f"equal: {sum(equal)} of {len(equal)} cases", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for S in (17, 65) if dev == "cuda" else ():
        for B in (1, 8, 32, 128):
            D, K = 8, 8
            probs = (torch.rand(B, D, K, generator=g) ** 3).softmax(-1).sort(-1, descending=True).values.to(dev)
            args = (torch.randint(0, 1000, (B,), generator=g).to(dev), probs,
                    torch.randint(0, 1000, (B, D, K), generator=g).to(dev), torch.full((B,), S - 1, device=dev), S,
                    torch.ones(MAX_DEPTH + 1, 3, device=dev))
            ms = {k: bench_graph_ms(lambda k=k: level_search_packed(*args, kernels=k)) for k in ("torch", "triton")}
            same = bool(torch.equal(level_search_packed(*args, kernels="torch"),
                                    level_search_packed(*args, kernels="triton")))
            rows.append(dict(batch=B, slots=S, top_k=K, depth=D, twin_us=round(ms["torch"] * 1e3, 1),
                             kernel_us=round(ms["triton"] * 1e3, 1), speedup=round(ms["torch"] / ms["triton"], 2),
                             equal=same))
            print(rows[-1], flush=True)
    write_results("level_search.json", rows, dict(equal=all(equal) and all(r["equal"] for r in rows),
                                                  cases=len(equal)))


if __name__ == "__main__":
    main()
