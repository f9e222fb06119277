"""Shared measuring tools for the GPU benchmarks: ceilings, timing, results JSON.

- ``device_ceilings()`` measures this GPU's copy bandwidth (device-to-device copy, bytes read +
  written) and dense bf16 matmul rate (8192^3, random data): the floors are computed from these.
- ``bench_ms(fn)`` is the median of ``triton.testing.do_bench`` (events, warm-up, L2 flushed
  between runs), in milliseconds.
- ``write_results(name, rows, extra)`` writes ``$OUT/<name>`` on the device machine, else
  ``benchmarks/results/<name>``, with device, torch, triton and the git commit at top level.
"""
from __future__ import annotations

import json
import os
import subprocess

import torch
import triton


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def device_ceilings() -> dict:
    n = 1 << 29  # 2 GiB of fp32 per buffer
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n * 4 / (copy_ms * 1e-3), "bf16_flops_per_s": 2 * 8192**3 / (mm_ms * 1e-3)}


def git_commit() -> str:
    if os.environ.get("BOLE_COMMIT"):
        return os.environ["BOLE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True).strip()
    except Exception:
        return "unknown"


def write_results(name: str, rows: list[dict], extra: dict | None = None) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    doc = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        **(extra or {}),
        "rows": rows,
    }
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    return path
