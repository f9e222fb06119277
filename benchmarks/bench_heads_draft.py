"""The block and MTP drafters' drafting step (``spec_decode/block_drafter.py``): trees searched on the host
over the heads' candidates (the runner's path up to 516ffa5: candidates copied to the host, a
synchronisation, the best-first search in numpy) against the device search (``HeadDrafter.grow_trees_async``:
heads, top-k and ``level_search_packed`` queued on the device, only the packed trees read), same process, same
heads, same hidden states; the device search launched op by op (``device_eager_ms``) and as one CUDA graph replay
per batch bucket (``device_graph_ms``, the runner's path on CUDA).

Shapes of the trained pair's heads (hidden 512, depth 8, SmolLM2's 49152-token vocabulary, top-k 8; random
weights: speed depends on shapes only), bf16, the LM head a [V, H] matmul. Per batch size B and budget: the
whole drafting call (hidden states given, the trees on the host at the end), median of ``--steps`` steps after a
warm-up, the device idle at each start. ``same_trees``: every request's tree (tokens, parents) equal in the three.

    python benchmarks/bench_heads_draft.py            # GPU: writes heads_draft.json
    python benchmarks/bench_heads_draft.py --quick    # CPU dry run
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import same_trees, write_results  # noqa: E402

from vllm_bole.spec_decode.best_first import best_first_slots  # noqa: E402
from vllm_bole.spec_decode.block_drafter import BlockHead, HeadDrafter, MTPHead  # noqa: E402

HIDDEN, VOCAB, DEPTH, TOP_K = 512, 49152, 8, 8


def timed(fn, dev: torch.device, steps: int) -> tuple[float, object]:
    """Median milliseconds of ``fn()`` over ``steps`` calls (after 3 warm-up calls), the device idle at each
    start; and the last result."""
    times = []
    for i in range(steps + 3):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.quick:
        args.batches, args.budgets, args.steps = [1, 4], [8], 3
    g = torch.Generator().manual_seed(0)
    lm_w = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dev, dtype)
    lm = lambda z: z @ lm_w.T  # noqa: E731
    heads = {"block": BlockHead(HIDDEN, DEPTH), "mtp": MTPHead(HIDDEN, DEPTH, VOCAB)}
    rows = []
    for kind, head in heads.items():
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head = head.to(dev, dtype).eval()
        for B in args.batches:
            h = torch.randn(B, HIDDEN, generator=g).to(dev, dtype)
            roots = torch.randint(0, VOCAB, (B,), generator=g).tolist()
            hists = [[r] for r in roots]
            for budget in args.budgets:
                eager, graphs = (HeadDrafter(head, lm, TOP_K, max_budget=max(args.budgets), cuda_graphs=g)
                                 for g in (False, True))

                def host():
                    eager.condition(h)
                    return best_first_slots(roots, eager.propose(hists, [DEPTH] * B), budget, max_depth=DEPTH)

                def device(drafter):
                    drafter.condition(h)
                    return drafter.grow_trees_async(roots, hists, [DEPTH] * B, budget, max_depth=DEPTH)()

                host_ms, a = timed(host, dev, args.steps)
                eager_ms, b = timed(lambda: device(eager), dev, args.steps)
                graph_ms, c = timed(lambda: device(graphs), dev, args.steps)
                same = all(same_trees([a.tree()], [x.tree()]) == 1.0 for x in (b, c))
                rows.append(dict(head=kind, B=B, budget=budget, host_ms=round(host_ms, 4),
                                 device_eager_ms=round(eager_ms, 4), device_graph_ms=round(graph_ms, 4),
                                 host_over_graph=round(host_ms / graph_ms, 2), graphs=graphs.runtime, same_trees=same))
                print(f"{kind:5s} B={B:4d} budget={budget:3d}  host {host_ms:7.3f} ms  device eager {eager_ms:7.3f} ms"
                      f"  graph {graph_ms:7.3f} ms  x{host_ms / graph_ms:5.2f}  same trees {same}", flush=True)
    shapes = dict(hidden=HIDDEN, vocab=VOCAB, depth=DEPTH, top_k=TOP_K, dtype=str(dtype).replace("torch.", ""),
                  steps=args.steps)
    if not args.quick:
        print("wrote", write_results("heads_draft.json", rows, dict(shapes=shapes)))


if __name__ == "__main__":
    main()
