"""Drafting speed: the paged in-engine draft model (``spec_decode/paged_draft.py``; eager and with
each step one CUDA graph replay; and drafting trees node by node, ``paged_tree_draft.py``, beam 2
and 4, each step one CUDA graph replay, ``_eager`` without) against the transformers drafter (``spec_decode/draft_model.py``, what the runner used
before), same process, same draft, same histories.

Draft: a Llama of the trained pair's draft shape (hidden 256, 2 layers, 4 heads, SmolLM2's 49152-token
vocabulary, tied embeddings; random weights: speed depends on shapes only), bf16. Per batch size B:
B histories of ``--prompt`` tokens; a steady-state step = every request accepted ``--accept`` chain
tokens plus a bonus since the last call, then ``propose`` at depth D (``--depth``), top-k 8. Reported:
milliseconds per step (median of ``--steps`` steps, whole ``propose`` call incl. host work and the
copy of the candidates to the host; for the tree drafters the whole ``grow_trees`` search of a
16-node tree; ``paged_trees_host`` / ``paged_trees_device``: the runner's whole drafting of 16-node
best-first trees, searched on the host over the candidates / inside the draft's step graph;
``paged_trees_device_twins``: the same with the draft forward's own ops, its decoder glue and top-k,
as their torch twins instead of their Triton launches), per
drafted node (B x D candidate rows; trees: B x 16 nodes), and the transformers /
paged ratio (issue 16's target: the in-engine draft model at least 5x faster per drafted node).
Correctness beside it: fp32 candidates of the paged model equal the transformers drafter's (ties
aside) after a few steps, every B; the trees searched in the step equal the host search's.

    python benchmarks/bench_draft.py                 # H200: writes draft_speed.json
    python benchmarks/bench_draft.py --quick         # CPU dry run (B = 1, 2; eager only)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import same_trees, write_results  # noqa: E402

from vllm_bole.spec_decode.best_first import best_first_tree  # noqa: E402
from vllm_bole.spec_decode.draft_model import HFDraftModel  # noqa: E402
from vllm_bole.spec_decode.paged_draft import PagedDraftModel  # noqa: E402
from vllm_bole.spec_decode.paged_tree_draft import PagedTreeDraftModel  # noqa: E402
from vllm_bole.spec_decode.step import draft_trees  # noqa: E402

TREE_NODES = 16

DRAFT = dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=4096)


def build_draft(root: Path, dtype: torch.dtype) -> str:
    import transformers

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DRAFT)).to(dtype)
    m.save_pretrained(root)
    return str(root)


def same_candidates(a, b, tol: float) -> bool:
    """Equal top-k tokens per depth, except where the reference has a tie within ``tol`` (then the
    chains may part and nothing deeper is compared)."""
    for r in range(a.tokens.shape[0]):
        for d in range(a.tokens.shape[1]):
            if not torch.equal(a.tokens[r, d], b.tokens[r, d]):
                p = b.probs[r, d]
                if not bool(((p[:-1] - p[1:]).abs() < tol).any()):
                    return False
                break
    return True


def steps(drafter, B: int, args, keys: bool, gen: torch.Generator, trees: str | None = None) -> tuple[list[float], list]:
    """Step times (ms) and the candidates of every step for ``B`` requests; ``trees``: the whole drafting of
    the runner instead, best-first trees of ``TREE_NODES`` nodes as ``draft_trees`` builds them (``"host"``:
    candidates to the host, searched there; ``"device"``: searched inside the step, ``grow_trees``)."""
    hists = [torch.randint(3, DRAFT["vocab_size"], (args.prompt,), generator=gen).tolist() for _ in range(B)]
    arrays = [np.array(h, dtype=np.int32) for h in hists]
    kw = dict(keys=[f"r{i}" for i in range(B)]) if keys else {}
    times, outs = [], []
    tree = isinstance(drafter, PagedTreeDraftModel)
    for s in range(args.steps + 1):
        if torch.device(drafter.device).type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if trees:
            roots = [h[-1] for h in hists]
            if trees == "host":
                c = best_first_tree(roots, drafter.propose(arrays, [args.depth] * B, **kw), TREE_NODES,
                                    max_depth=args.depth)
            else:
                c, _ = draft_trees(drafter, roots, arrays, [args.depth] * B, TREE_NODES, max_depth=args.depth, **kw)
        elif tree:  # the search's slots as the runner's TreeBatch, built once
            c = drafter.grow_trees([h[-1] for h in hists], arrays, [args.depth] * B, TREE_NODES, max_depth=args.depth,
                                   **kw).tree()
        else:
            c = drafter.propose(arrays, [args.depth] * B, **kw)
        times.append((time.perf_counter() - t0) * 1e3)
        # each request accepts its first-child chain (read after the timer: the runner's verification does that)
        chain = ([c.request(i)[1][1: args.accept + 1] for i in range(B)] if trees or tree
                 else [c.tokens[i, : args.accept, 0].tolist() for i in range(B)])
        outs.append(c)
        for i, h in enumerate(hists):
            h += chain[i] + [int(torch.randint(3, DRAFT["vocab_size"], (1,), generator=gen))]
        arrays = [np.array(h, dtype=np.int32) for h in hists]  # as the runner hands them: numpy views
    if keys:
        drafter.release(kw["keys"])
    return times[1:], outs  # the first step is the prompt's catch-up (and the graph capture)


def replay_ms(drafter, B: int) -> float | None:
    """Median GPU time of the step's graph replay alone (the drafter's captured bucket for ``B``),
    None for drafters without one: the rest of ``step_ms`` is host work."""
    graphs = getattr(drafter, "_graphs", {})
    bucket = min((b for b in graphs if b >= B), default=None)
    if bucket is None:
        return None
    graph = graphs[bucket][0]
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def kernel_profile(drafter, B: int) -> list[dict]:
    """The kernels of one replay of the step graph for ``B`` rows (torch profiler): count and
    microseconds per kernel name, most time first."""
    from torch.profiler import ProfilerActivity, profile

    graph = drafter._graphs[min(b for b in drafter._graphs if b >= B)][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    table: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            n, us = table.get(e.name[:60], (0, 0.0))
            table[e.name[:60]] = (n + 1, us + e.device_time)
    return [dict(kernel=k, count=n, us=round(us, 1)) for k, (n, us) in sorted(table.items(), key=lambda x: -x[1][1])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--accept", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.batches, args.prompt, args.steps = [1, 2], 64, 3
    tmp = Path(tempfile.mkdtemp())
    rows, checks = [], []
    for dtype in (torch.float32, torch.bfloat16):  # fp32: correctness; bf16: speed
        path = build_draft(tmp / str(dtype).split(".")[-1], dtype)
        hf = HFDraftModel(path, top_k=8, device=dev)
        kinds = {"transformers": hf}
        common = dict(top_k=8, device=dev, max_len=args.prompt + 64 * (args.steps + 2), depth=args.depth,
                      max_requests=max(args.batches))
        graphs = dev == "cuda"
        for g in ((False, True) if graphs else (False,)):
            kinds[f"paged_{'graphs' if g else 'eager'}"] = PagedDraftModel(path, cuda_graphs=g, **common)
        for beam in (2, 4):  # node by node: the step graph (CUDA), and eagerly, its baseline
            for g in ((True, False) if graphs else (False,)):
                kinds[f"paged_tree_beam{beam}{'' if g else '_eager'}"] = PagedTreeDraftModel(path, beam=beam, cuda_graphs=g,
                                                                                             **common)
        # the runner's whole drafting; "_twins": the draft forward's own ops (decoder glue, top-k) as their torch
        # twins, the A/B of their Triton launches in this process
        modes = {"paged_trees_host": "host", "paged_trees_device": "device", "paged_trees_device_twins": "device"}
        for k in modes:
            kinds[k] = PagedDraftModel(path, cuda_graphs=graphs, **common)
        kinds["paged_trees_device_twins"].decoder.kernels = "torch"
        for B in args.batches:
            res = {k: steps(d, B, args, k != "transformers", torch.Generator().manual_seed(B), modes.get(k))
                   for k, d in kinds.items()}
            if dtype == torch.float32:
                ref = res["transformers"][1]
                for k, (_, outs) in res.items():
                    if k.startswith("paged_") and "tree" not in k:
                        ok = all(same_candidates(a, b, 1e-4) for a, b in zip(outs, ref))
                        checks.append(dict(batch=B, drafter=k, fp32_equal_to_transformers=ok))
                # the host search reads the same values: equal; the twin ops round in another order (RMSNorm's and
                # the log-sum-exp's sums), so a near-tie among the candidates may flip: the share of equal trees
                for beam in (2, 4) if graphs else ():  # the same search in the graph and eagerly: near-ties may flip
                    checks.append(dict(batch=B, drafter=f"paged_tree_beam{beam}", fp32_trees_same_frac_graph_vs_eager=same_trees(
                        *(res[f"paged_tree_beam{beam}{e}"][1] for e in ("", "_eager")))))
                checks.append(dict(batch=B, drafter="paged_trees_device",
                                   fp32_trees_equal_to_host_search=same_trees(res["paged_trees_device"][1],
                                                                              res["paged_trees_host"][1]) == 1.0,
                                   fp32_trees_same_frac_with_twin_ops=same_trees(res["paged_trees_device"][1],
                                                                                 res["paged_trees_device_twins"][1])))
                continue
            base = statistics.median(res["transformers"][0])
            for k, (ts, _) in res.items():
                ms = statistics.median(ts)
                nodes = B * (TREE_NODES if "tree" in k else args.depth)
                rows.append(dict(drafter=k, runtime=kinds[k].runtime, batch=B, depth=args.depth, prompt=args.prompt,
                                 dtype="bfloat16", step_ms=round(ms, 3), ms_per_node=round(ms / nodes, 4),
                                 speedup_vs_transformers=round(base / ms, 2), replay_ms=replay_ms(kinds[k], B)))
                print(f"B={B:4d} {k:18s} {ms:8.3f} ms/step {ms / nodes:8.4f} ms/node {base / ms:6.2f}x "
                      f"replay {rows[-1]['replay_ms']} ms", flush=True)
        graph_drafter = kinds.get("paged_graphs")
        del kinds, hf
    print("fp32 equality:", checks)
    prof = {}
    if dev == "cuda":
        for B in (1, 32):
            prof[B] = kernel_profile(graph_drafter, B)
            print(f"B={B}: {sum(k['count'] for k in prof[B])} kernels, {sum(k['us'] for k in prof[B]):.0f} us:",
                  prof[B][:12], flush=True)
    print(write_results("draft_speed.json", rows, dict(draft=DRAFT, checks=checks, settings=vars(args),
                                                       replay_kernels=prof)))


if __name__ == "__main__":
    main()
