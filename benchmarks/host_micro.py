"""Wall time of the tree step's host operations that the H200 profile of a step at c = 1 ranked highest
(``profile_step_async_b1.json``: there the GPU is busy ~15% of the step and the host work is the step), each
alone, on this machine's CPU, torch only (no vLLM, no GPU):

* ``slots_tree``: :meth:`Slots.tree` (the drafted trees as the step's TreeBatch), 16-node best-first trees;
* ``kind_counts``: :func:`calibration.kind_counts` of a verified tree (a fresh tree each call, as the runner's);
* ``calibration_update``: :meth:`Calibration.update` then :meth:`Calibration.factors`, as each step does;
* ``pack_unpack``: :func:`transfer.pack` and :func:`transfer.unpack` of a step's tree and table tensors (the
  host side of ``upload_many``; the copy itself is the device's).

Per operation and batch B (1, 8, 32): median microseconds over ``--reps`` calls (after a warm-up). Writes
``host_micro.json`` (``rows``: ``op, batch, us``; ``cpu``: the host's model) where ``harness.write_results`` puts
results. The same script run over an older checkout of ``vllm_bole`` is its baseline (its results file then
named with that commit).

    python benchmarks/host_micro.py [--reps 2000]
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results  # noqa: E402

from vllm_bole.spec_decode.best_first import best_first_slots  # noqa: E402
from vllm_bole.spec_decode.calibration import Calibration, kind_counts  # noqa: E402
from vllm_bole.spec_decode.candidates import Candidates  # noqa: E402
from vllm_bole.spec_decode.tree import TreeBatch  # noqa: E402
from vllm_bole.transfer import pack, unpack  # noqa: E402

DEPTH, TOP_K, NODES = 6, 8, 16


def _slots(B: int):
    """Best-first search state of ``B`` requests, ``NODES`` draft nodes each, random per-depth candidates."""
    g = torch.Generator().manual_seed(B)
    c = Candidates.empty(B, DEPTH, TOP_K)
    c.tokens[:] = torch.randint(3, 50000, (B, DEPTH, TOP_K), generator=g)
    c.probs[:] = torch.rand(B, DEPTH, TOP_K, generator=g).sort(-1, descending=True).values / TOP_K
    return best_first_slots(torch.arange(B), c, torch.full((B,), NODES), max_depth=DEPTH)


def _median_us(fn, reps: int) -> float:
    for _ in range(max(reps // 10, 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    rows = []
    for B in args.batches:
        slots = _slots(B)
        tree = slots.tree()
        fields = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
        accepted = torch.full((B, DEPTH + 1), -1, dtype=torch.long)
        accepted[:, :3] = torch.tensor([0, 1, 2])  # each request accepts its first two main-path nodes
        fresh = iter([TreeBatch(**fields) for _ in range(args.reps + max(args.reps // 10, 10))])
        cal, counts = Calibration(), kind_counts(tree, accepted)
        step_tensors = [tree.token_ids, tree.parent, tree.depth, tree.cu_nodes, tree.path, tree.anc_mask,
                        tree.draft_prob, torch.zeros(tree.num_nodes, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                        torch.zeros(B, 64, dtype=torch.int32), torch.zeros(B, dtype=torch.long)]
        buf, spans = pack(step_tensors)
        ops = dict(slots_tree=slots.tree, kind_counts=lambda: kind_counts(next(fresh), accepted),
                   calibration_update=lambda: (cal.update(counts), cal.factors()),
                   pack_unpack=lambda: unpack(pack(step_tensors)[0], step_tensors, spans))
        for op, fn in ops.items():
            rows.append(dict(op=op, batch=B, us=_median_us(fn, args.reps)))
            print(f"B={B:3d} {op:20s} {rows[-1]['us']:8.1f} us", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    print(write_results("host_micro.json", rows, dict(cpu=cpu, settings=vars(args), nodes_per_tree=NODES + 1,
                                                      depth=DEPTH)))


if __name__ == "__main__":
    main()
