"""The smoke job: tiny random-weight hybrids through vLLM (with this plugin loaded) against transformers.

    python -m vllm_bole.smoke [--arch qwen3_next --arch mamba2 ...] [--cache DIR] [--in-process] [--json FILE]

Builds the tiny checkpoints of ``vllm_bole.testing.tiny_models`` into ``$VLLM_BOLE_CACHE/tiny`` (default
``~/.cache/vllm_bole/tiny``; reused when already built), then for each architecture starts one vLLM
engine in its own subprocess, decodes 4 prompts x 24 tokens greedily, and compares with transformers
greedy decoding of the same checkpoint (fp32: identical tokens; bf16: near-ties within a documented
bound, see ``vllm_bole.testing.smoke_run``). It also checks that vLLM loaded the ``vllm_bole`` plugin in
the engine's worker process. Prints one line per architecture and exits 1 if any fails.

By default vLLM runs as it does for users (engine core and worker in their own processes, about
50 s per architecture on a 2-core CPU); ``--in-process`` keeps them in the engine subprocess
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, about 20-30 s per architecture).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from vllm_bole.testing.smoke_run import run_smoke
from vllm_bole.testing.tiny_models import ARCHS, default_cache_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_bole.smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=ARCHS, help="check only these (repeatable; default all)")
    ap.add_argument("--cache", type=Path, default=None, help=f"model cache dir (default {default_cache_dir()})")
    ap.add_argument("--in-process", action="store_true",
                    help="run vLLM's engine core and worker inside the engine subprocess (faster)")
    ap.add_argument("--json", type=Path, default=None, help="also write the per-arch results here")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    reports = run_smoke(args.arch, args.cache, multiprocessing=not args.in_process,
                        log=lambda line: print(line, flush=True))
    failed = [r.arch for r in reports if not r.ok]
    print(f"{len(reports) - len(failed)}/{len(reports)} architectures: vLLM matches HF (fp32 exactly, bf16 within "
          "tolerance)"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + f" ({time.monotonic() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([dict(arch=r.arch, dtype=r.dtype, ok=r.ok, seconds=r.seconds,
                                              problems=r.problems, agreement=asdict(r.agreement),
                                              off_argmax=r.off_argmax()) for r in reports], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
