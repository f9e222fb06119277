"""Wall time of the tree step's host operations that the H200 profile of a step at c = 1 ranked highest
(``profile_step_async_b1.json``: there the GPU is busy ~15% of the step and the host work is the step), each
alone, on this machine's CPU, torch only (no vLLM, no GPU):

* ``slots_tree``: :meth:`Slots.tree` (the drafted trees as the step's TreeBatch), 16-node best-first trees;
* ``kind_counts``: :func:`calibration.kind_counts` of a verified tree (a fresh tree each call, as the runner's);
* ``calibration_update``: :meth:`Calibration.update` then :meth:`Calibration.factors`, as each step does;
* ``pack_unpack``: :func:`transfer.pack` and :func:`transfer.unpack` of a step's tree and table tensors (the
  host side of ``upload_many``; the copy itself is the device's);
* ``choose_cut``: the budget controller's step under ``budget: "auto"``, :meth:`BudgetController.search_budget`,
  :meth:`BudgetController.choose` and the cut ``Slots.tree(keep=...)``, by a controller that has learnt its lines
  over 64 steps of the batch (against ``slots_tree``: what ``"auto"`` adds to a fixed budget's drafting; on the
  H100 at 192c57d the auto cells' drafting took 0.5-0.8 ms a step more than the fixed budgets').

Per operation and batch B (1, 8, 32): median microseconds over ``--reps`` calls (after a warm-up). Writes
``host_micro.json`` (``rows``: ``op, batch, us``; ``cpu``: the host's model) where ``harness.write_results`` puts
results. The same script run over an older checkout of ``vllm_bole`` is its baseline (its results file then
named with that commit).

    python benchmarks/host_micro.py [--reps 2000]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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
from vllm_bole.spec_decode.controller import BudgetController, Roofline, StepCostModel  # noqa: E402
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


def _controller(slots, kv_lens: list) -> BudgetController:
    """A controller over a 70M-parameter hybrid's prior on an H100 and vLLM's graph sizes, its forward, drafting and
    rest lines learnt from 64 steps of this batch (each measured near 30x the forward's prior, as on the H100)."""
    roof = Roofline(weight_bytes=1.4e8, params_active=7e7, kv_bytes_per_token=4096, attn_flops_per_pair=8192,
                    state_bytes=1e6, bandwidth=3.35e12, peak_flops=9.89e14, overhead_s=1e-4)
    ctl = BudgetController(StepCostModel(roof), buckets=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512])
    B = len(kv_lens)
    for i in range(64):
        ctl.search_budget(NODES)
        c = ctl.choose(slots.logrho, slots.valid, kv_lens)
        ctl.cost_model(B).observe(c.bucket, c.prior_s, c.prior_s * (30 + i % 3))
        ctl.draft.observe(B, c.search, 2e-3 + 1e-5 * c.search * (i % 2))
        ctl.rest.observe(B, c.total, 1.5e-3 + 1e-6 * c.total * (i % 2))
    return ctl


def _choose_cut(ctl: BudgetController, slots, kv_lens: list):
    ctl.search_budget(NODES)
    return slots.tree(keep=ctl.choose(slots.logrho, slots.valid, kv_lens).keep)


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
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
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
        kv_lens = [500 + 37 * b for b in range(B)]
        ops = dict(slots_tree=slots.tree, kind_counts=lambda: kind_counts(next(fresh), accepted),
                   calibration_update=lambda: (cal.update(counts), cal.factors()),
                   pack_unpack=lambda: unpack(pack(step_tensors)[0], step_tensors, spans),
                   choose_cut=functools.partial(_choose_cut, _controller(slots, kv_lens), slots, kv_lens))
        for op, fn in ops.items():
            rows.append(dict(op=op, batch=B, us=_median_us(fn, args.reps)))
            print(f"B={B:3d} {op:20s} {rows[-1]['us']:8.1f} us", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    print(write_results("host_micro.json", rows, dict(cpu=cpu, settings=vars(args), nodes_per_tree=NODES + 1,
                                                      depth=DEPTH)))


if __name__ == "__main__":
    main()
