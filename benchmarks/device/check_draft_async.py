"""The runner's drafting path on CUDA: ``draft_trees`` through ``PagedDraftModel.grow_trees_async`` (the
step graph with the best-first search inside, the trees copied into pinned memory behind it and read
after an event) against ``propose`` + the host search on a second drafter with the same graphs, over
steps of growing histories; and, on a third drafter, the launch behind a step (``pending``: each step's
new tokens still on the device, the draft on its own stream after the current one's work, as the runner
launches it from ``_sample``) equal to the first, with a synchronisation of the current stream right
after the launch timed (it must not wait for the draft). Writes ``draft_async.json`` (``equal``,
``pending_equal``, per-step milliseconds).

    python3 benchmarks/device/check_draft_async.py DRAFT_DIR     # e.g. the tiny Llama checkpoint
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import write_results  # noqa: E402

from vllm_bole.spec_decode.best_first import best_first_tree  # noqa: E402
from vllm_bole.spec_decode.paged_draft import PagedDraftModel  # noqa: E402
from vllm_bole.spec_decode.step import draft_trees, draft_trees_async  # noqa: E402


def main() -> None:
    path, B, D, budget = sys.argv[1], 4, 6, 16
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run
    kw = dict(top_k=8, device=dev, max_len=512, depth=D, max_requests=B, max_budget=budget)
    dev_search, host_search, behind = (PagedDraftModel(path, "float32", **kw) for _ in range(3))
    rng = np.random.default_rng(0)
    hists = [rng.integers(3, 1000, int(n)).astype(np.int32) for n in (40, 7, 120, 65)]
    keys, rows = [f"r{i}" for i in range(B)], []
    new, counts = None, None  # the tokens the last step added, on the device, for ``behind``
    for step in range(5):
        roots = [int(h[-1]) for h in hists]
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        got, _ = draft_trees(dev_search, roots, hists, [D] * B, budget, max_depth=D, keys=keys)
        t1 = time.perf_counter()
        want = best_first_tree(roots, host_search.propose(hists, [D] * B, keys=keys), budget, max_depth=D)
        t2 = time.perf_counter()
        if new is None:  # the prompts: every token on the host
            chained, _ = draft_trees(behind, roots, hists, [D] * B, budget, max_depth=D, keys=keys)
            sync_ms = None
        else:
            old = [h[: len(h) - n] for h, n in zip(hists, counts.tolist())]
            with behind.after((new, counts)):
                finish = draft_trees_async(behind, None, old, [D] * B, budget, max_depth=D, keys=keys,
                                           pending=(new, counts))
            t3 = time.perf_counter()
            new.sum().item()  # the current stream's synchronisation, as vLLM's reading of the sampled tokens
            sync_ms = round(1e3 * (time.perf_counter() - t3), 3)
            chained, _ = finish()
        rows.append(dict(step=step, equal=bool(torch.equal(got.token_ids, want.token_ids)
                                               and torch.equal(got.parent, want.parent)),
                         pending_equal=bool(torch.equal(got.token_ids, chained.token_ids)
                                            and torch.equal(got.parent, chained.parent)),
                         device_search_ms=round(1e3 * (t1 - t0), 3), host_search_ms=round(1e3 * (t2 - t1), 3),
                         current_stream_sync_ms=sync_ms))
        print(rows[-1], flush=True)
        added = [f[:2] + [int(rng.integers(3, 1000))] for f in got.draft_token_ids()]
        hists = [np.concatenate([h, np.array(a, dtype=np.int32)]) for h, a in zip(hists, added)]
        counts = torch.tensor([len(a) for a in added], device=dev)
        new = torch.tensor([a + [-1] * (3 - len(a)) for a in added], device=dev)
    print(write_results("draft_async.json", rows, dict(draft=path, batch=B, depth=D, budget=budget,
                                                       equal=all(r["equal"] for r in rows),
                                                       pending_equal=all(r["pending_equal"] for r in rows))))


if __name__ == "__main__":
    main()
