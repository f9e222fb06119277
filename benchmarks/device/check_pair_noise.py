"""Are the trained pair's bf16 tree streams within the engine's own noise? On the H200 at 59e0ecd 79-94% of
the trees' greedy MT-Bench requests equalled AR's whole 128 tokens against 98-100% for vLLM's chain. This
runs AR (logprobs, and its streams rescored through its prefill path: the engine's own noise), the draft
model's trees (budget 16) and vLLM's chain (k = 3) on the same prompts at one concurrency, engines started
side by side, and judges both speculative runs by ``lossless.compare_greedy`` (bf16: every margin change
at the positions shared up to each stream's parting within ``NOISE_FACTOR`` x the engine's noise; the
partings with AR's margin between its token and the other run's). Writes ``pair_noise.json`` (``rows``:
``mode, streams, identical, ok, worst, noise, partings, problems``).

    python3 benchmarks/device/check_pair_noise.py --pair /tmp/pair --data /tmp/pd --tree-graphs
    python benchmarks/device/check_pair_noise.py --pair PAIR --data DATA --eager --prompts 4 --tokens 16  # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import engine_kwargs, prompts_for, spec_for  # noqa: E402
from vllm_bole.testing import engine_run  # noqa: E402
from vllm_bole.testing.lossless import compare_greedy  # noqa: E402

TOP = 5  # logprobs per position


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", type=Path, default=Path("/tmp/pair"))
    ap.add_argument("--data", type=Path, default=Path("/tmp/pd"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tree-graphs", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (CPU dry runs)")
    args = ap.parse_args()
    prompts = prompts_for(json.loads((args.data / "prompts.json").read_text()), "mt_bench", args.prompts)
    kw = engine_kwargs(argparse.Namespace(dtype="bfloat16", eager=args.eager, parallel=True,
                                          target=args.pair / "nemotron_h"))
    if args.eager:  # the tiny checkpoints of a CPU dry run
        kw["max_model_len"] = 512
    modes = {"ar": None, "bole_tree": spec_for("bole_tree", "draft_model", args.pair),
             "vllm_chain": spec_for("vllm_chain", "draft_model", args.pair, 3)}

    def run(mode):
        job = engine_run.generate_job(prompts, args.tokens, logprobs=TOP, concurrency=args.concurrency,
                                      rescore=TOP if mode == "ar" else None, budget=16 if mode == "bole_tree" else None)
        graphs = args.tree_graphs and mode == "bole_tree"
        try:
            return engine_run.run_engine(args.pair / "nemotron_h", [job], spec=modes[mode], llm_kwargs=kw,
                                         env={"VLLM_BOLE_TREE_GRAPHS": "1"} if graphs else None)["jobs"][0]
        except Exception as e:  # noqa: BLE001 - the mode's result is its error
            return dict(error=f"{type(e).__name__}: {e}"[-2000:])

    with ThreadPoolExecutor(len(modes)) as pool:
        out = dict(zip(modes, pool.map(run, modes)))
    rows = []
    for mode in ("bole_tree", "vllm_chain"):
        if "error" in out[mode] or "error" in out["ar"]:
            rows.append(dict(mode=mode, error=out[mode].get("error") or out["ar"].get("error")))
        else:
            v = compare_greedy("bfloat16", out["ar"], out[mode])
            rows.append(dict(mode=mode, streams=v.streams, identical=v.identical, ok=v.ok, worst=v.worst,
                             noise=v.noise, partings=v.partings, problems=v.problems[:5]))
        print(json.dumps(rows[-1])[:600], flush=True)
    head = dict(commit=os.environ.get("BOLE_COMMIT"), pair=str(args.pair), prompts=args.prompts, tokens=args.tokens,
                concurrency=args.concurrency, tree_graphs=args.tree_graphs, top=TOP)
    (Path(os.environ.get("OUT", ".")) / "pair_noise.json").write_text(json.dumps(dict(head, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
