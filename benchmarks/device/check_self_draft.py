"""Draft alignment in the e2e engines' own configuration: the target as its own drafter (``draft_model`` =
the same checkpoint), chain-shaped trees (``top_k`` 1), so every step should accept the whole chain
(``budget`` + 1 tokens) for every request whatever the model's quality; a request well below that is one
whose draft saw another context (paging, slot reuse, a graph's stale buffer). Seen on the H200
(2026-12-03, 651deac): some MT-Bench requests of the e2e cells accepted 1.01-1.18 tokens per tree step
where the same prompts' worst was 2.13 at d8485d7. The CPU path (eager, fp32) accepts 9.0 of 9 for all
80 MT-Bench prompts.

    python3 benchmarks/device/check_self_draft.py --model /tmp/pair/draft --data /tmp/pd --tree-graphs  # H200
    python benchmarks/device/check_self_draft.py --model /tmp/pair_tiny/draft --data .pair/data --eager --dtype float32

Cells as ``bench_e2e.py`` runs them (waves of ``concurrency`` requests, every MT-Bench prompt, the same
engine arguments). Writes ``self_draft.json``: per cell the tokens per tree step of each request (min,
p10, p50, p90), the requests below ``--floor`` with their prompt lengths, and ``aligned`` (none below).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_e2e  # noqa: E402
from harness import write_results  # noqa: E402

from vllm_bole.testing import engine_run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint vLLM loads (the pair's draft: Llama)")
    ap.add_argument("--data", type=Path, default=Path(".pair/data"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tree-graphs", action="store_true", help="tree steps from whole CUDA graphs (as the e2e rows)")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--floor", type=float, default=None,
                    help="default: the budget in float32 (the chain less one token), half of it in bf16 (rounding"
                         " flips near ties between vLLM's forward and the paged draft's)")
    args = ap.parse_args()
    floor = args.floor if args.floor is not None else args.budget / (1 if args.dtype == "float32" else 2)
    prompts = json.loads((args.data / "prompts.json").read_text())["mt_bench"]
    spec = dict(method="bole_tree", drafter="draft_model", model=str(args.model), num_speculative_tokens=args.budget,
                max_depth=args.budget, top_k=1)
    kw = bench_e2e.engine_kwargs(argparse.Namespace(dtype=args.dtype, eager=args.eager, parallel=False,
                                                    target=args.model))
    jobs = [engine_run.generate_job(prompts, args.tokens, budget=args.budget, concurrency=c) for c in args.concurrency]
    out = engine_run.run_engine(args.model, jobs, spec=spec, llm_kwargs=kw, timeout=560,
                                env={"VLLM_BOLE_TREE_GRAPHS": "1"} if args.tree_graphs else None)
    rows = []
    for c, res in zip(args.concurrency, out["jobs"]):
        means = bench_e2e.per_request(res["stats"])
        low = sorted((m, rid) for rid, m in means.items() if m < floor)
        prompt_len = lambda rid: len(prompts[int(rid.split("-")[0]) % len(prompts)])  # noqa: E731 - ids count up
        rows.append(dict(concurrency=c, requests=len(means), **bench_e2e.request_spread(res["stats"]), num_low=len(low),
                         low=[dict(request=rid, tokens_per_step=round(m, 3), prompt_tokens=prompt_len(rid))
                              for m, rid in low][:20]))
        print({k: v for k, v in rows[-1].items() if k != "low"}, flush=True)
    print(write_results("self_draft.json", rows, dict(model=str(args.model), dtype=args.dtype, eager=args.eager,
                                                      tree_graphs=args.tree_graphs, budget=args.budget, floor=floor,
                                                      aligned=all(r["num_low"] == 0 for r in rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
