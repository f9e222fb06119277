"""Shared measuring tools for the GPU benchmarks: ceilings, timing, results JSON.

- ``device_ceilings()`` measures this GPU's copy bandwidth (device-to-device copy, bytes read +
  written) and dense bf16 matmul rate (8192^3, random data): the floors are computed from these.
- ``bench_ms(fn)`` is the median time of ``fn`` in milliseconds, replayed from a CUDA graph
  (``triton.testing.do_bench_cudagraph``) so that host launch overhead is out of the numbers for
  every method alike; ``graph=False`` uses ``do_bench`` (events, L2 flushed between runs).
- ``bench_graph_ms(fn)`` captures one call of ``fn`` in a CUDA graph and times its replays with
  ``do_bench`` (no launch gaps, and L2 flushed between replays, unlike ``do_bench_cudagraph``:
  a layer's KV does not sit in L2 in a real forward); ``fn`` must be capturable (no host
  syncs; autotuning happens in the warm-up calls).
- ``roofline_floor_ms(nbytes, flops, ceilings)``: max(bytes / copy bandwidth, flops / matmul
  rate) in ms, and which term binds.
- ``write_results(name, rows, extra)`` writes ``$OUT/<name>`` on the device machine, else
  ``benchmarks/results/<name>``, with device, torch, triton and the git commit at top level.
"""
from __future__ import annotations

import json
import os
import subprocess

import torch
import triton


def bench_ms(fn, warmup: int = 25, rep: int = 60, graph: bool = True) -> float:
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph_ms(fn, warmup: int = 25, rep: int = 100, warmup_calls: int = 2) -> float:
    for _ in range(warmup_calls):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the side stream too (allocator, lazy handles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    ms = bench_ms(graph.replay, warmup=warmup, rep=rep, graph=False)  # L2 flushed between replays
    del graph
    return ms


def roofline_floor_ms(nbytes: float, flops: float, ceilings: dict) -> tuple[float, str]:
    t_mem = nbytes / ceilings["copy_bytes_per_s"] * 1e3
    t_math = flops / ceilings["bf16_flops_per_s"] * 1e3
    return (t_mem, "memory") if t_mem >= t_math else (t_math, "compute")


def device_ceilings() -> dict:
    n = 1 << 29  # 2 GiB of fp32 per buffer
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src), graph=False)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b, graph=False)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n * 4 / (copy_ms * 1e-3), "bf16_flops_per_s": 2 * 8192**3 / (mm_ms * 1e-3)}


def git_commit() -> str:
    """``BOLE_COMMIT`` when set (pass it on the device machine: its copy of the tree keeps the
    session's first HEAD, seen 2026-12-03), else HEAD, with ``+uncommitted`` when the tracked files
    differ from it."""
    if os.environ.get("BOLE_COMMIT"):
        return os.environ["BOLE_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here).returncode != 0
        return sha + ("+uncommitted" if dirty else "")
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


def same_trees(xs, ys) -> float:
    """The share of request trees (parents and tokens) equal between two drafters' steps (lists of TreeBatch)."""
    same = total = 0
    for x, y in zip(xs, ys):
        cx, cy = x.cu_nodes.tolist(), y.cu_nodes.tolist()
        for r in range(len(cx) - 1):
            a, b = slice(cx[r], cx[r + 1]), slice(cy[r], cy[r + 1])
            same += torch.equal(x.parent[a], y.parent[b]) and torch.equal(x.token_ids[a], y.token_ids[b])
            total += 1
    return round(same / max(total, 1), 4)
