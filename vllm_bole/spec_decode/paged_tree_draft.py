"""The paged draft model drafting trees node by node: every node's children come from the draft's
distribution after that node's own path, not from one candidate row per depth of the greedy chain.

Best-first search (:func:`~vllm_bole.spec_decode.best_first.grow`, the runtime builder's search,
calibration included) with the draft as its expansion: after the catch-up (the roots' children,
:meth:`PagedDraftModel._catch_up`), each depth level's ``beam`` best frontier nodes of every request
go through ONE draft forward. A request's expanded nodes get KV slots ``len(history) + j`` in
expansion order (``j`` = their draft index, kept in the search state's ``row``); their queries
attend to the history and, through ``tree_attention``'s ``num_keys``, to the request's earlier
expanded nodes by ancestor bits (an expanded node: its parent's bits and its own). The pages hold
``len(history) + beam * (depth - 1)`` tokens per request; the tree's K/V are scratch, as the chain's.

Measured offline (``benchmarks/acceptance_quality.py``, a draft head on SmolLM2-135M): drafting
node by node accepts 9% more tokens per step than the same draft's chain candidates at 32 nodes,
16% at 64. It costs ``depth - 1`` draft forwards of up to ``beam`` tokens per request (the chain:
one token), run eagerly (the frontier's shape changes every level; the chain drafter's steps replay
a CUDA graph). Engine-agnostic; ``draft_beam`` in the engine config selects it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm_bole.spec_decode.best_first import Slots, budgets, grow
from vllm_bole.spec_decode.paged_draft import WORDS, PagedDraftModel, with_pending
from vllm_bole.spec_decode.tree import MAX_NODES

__all__ = ["PagedTreeDraftModel"]


@dataclass
class _Frontier:
    """tree_attention's view of one level's frontier: query rows per request and their ancestor bits
    over the request's expanded nodes."""

    cu_nodes: torch.Tensor  # [R + 1] int32
    anc_mask: torch.Tensor  # [F, WORDS] int32
    max_nodes: int


class PagedTreeDraftModel(PagedDraftModel):
    """A :class:`~vllm_bole.spec_decode.candidates.TreeDrafter`: :meth:`grow_trees` (arguments as
    :class:`PagedDraftModel`, plus ``beam``: frontier nodes expanded per request and depth)."""

    def __init__(self, *args, beam: int = 4, **kwargs):
        super().__init__(*args, cuda_graphs=False, **kwargs)
        if not 1 <= beam or beam * max(self.depth - 1, 1) > MAX_NODES:
            raise ValueError(f"draft_beam: {beam} must be >= 1 with draft_beam * (max_depth - 1) <= {MAX_NODES}")
        self.beam = int(beam)

    @property
    def runtime(self) -> str:
        return f"paged tree, {self.beam} frontier nodes per depth ({self.pool.num_pages} pages of " \
               f"{self.pool.page_size}, eager)"

    def grow_trees_async(self, roots, histories, *args, pending=None, **kwargs):
        """:meth:`grow_trees` now (node by node: each depth's forward waits for the previous depth's
        search), its result returned by the callable (the interface of the per-depth drafter's; ``pending``
        tokens on the device are read first)."""
        if pending is not None:
            roots, histories = with_pending(histories, pending)
        found = self.grow_trees(roots, histories, *args, **kwargs)
        return lambda: found

    @torch.inference_mode()
    def grow_trees(self, roots, histories: Sequence, depths: Sequence[int], budget, *, keys: Sequence | None = None,
                   max_depth: int, top_k: int | None = None, calibration: torch.Tensor | None = None) -> Slots:
        """The best-first trees of ``budget`` draft nodes (int or [B]) per request, drafted node by
        node (module docstring), as the search's :class:`Slots` (CPU). Requests with depth 0, an
        empty history or no room in the pool get their root alone."""
        B = len(histories)
        D = min(max((int(d) for d in depths), default=0), int(max_depth), self.depth)
        c = min(int(top_k or self.top_k), self.top_k)
        keys, temp, dep, live, hists = self._admit(histories, [min(int(d), D) for d in depths], keys,
                                                   self.beam * max(D - 1, 0) + 1)
        caps = budgets(budget, B, "cpu").clone()
        caps[[i for i in range(B) if i not in set(live)]] = 0
        root = torch.as_tensor(list(roots), dtype=torch.long)
        if not live:
            out = grow(root, lambda *a: None, caps, 0)
        else:
            out = grow(root, self._expander(live, hists, [keys[i] for i in live], dep, c), caps, D, beam=self.beam,
                       calibration=calibration)
        if temp:
            self.release(keys)
        return out

    def _expander(self, live, hists, keys, dep, c):
        """The ``expand`` of :func:`grow` for the live rows: the catch-up now, one forward per level."""
        dev, ps, B = self.device, self.pool.page_size, len(dep)
        L, table, first_t, first_p = self._catch_up(live, hists, keys)
        row_of = torch.full((B,), -1, dtype=torch.long)
        row_of[live] = torch.arange(len(live))
        depth_of = torch.tensor(dep, dtype=torch.long)
        Lt = torch.from_numpy(L)
        count = torch.zeros(B, dtype=torch.long)  # expanded nodes per request
        anc = torch.zeros(B, self.beam * max(self.depth - 1, 1), WORDS, dtype=torch.int64)  # their ancestor bits

        def expand(fb, fs, d, s):
            r = row_of[fb]
            probs = torch.zeros(fb.numel(), c)
            toks = torch.zeros(fb.numel(), c, dtype=torch.long)
            if d == 0:
                return first_p[r.to(dev)][:, :c].cpu(), first_t[r.to(dev)][:, :c].cpu(), None
            go = d < depth_of[fb]  # a request's own depth ends its tree
            rows = torch.full((fb.numel(),), -1, dtype=torch.long)
            if not bool(go.any()):
                return probs, toks, rows
            gb, gs = fb[go], fs[go]
            uniq, sizes = torch.unique_consecutive(gb, return_counts=True)
            start = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
            j = count[gb] + torch.arange(gb.numel()) - start
            count[uniq] += sizes
            jp = s.row[gb, s.parent[gb, gs]]
            words = torch.where((jp >= 0)[:, None], anc[gb, jp.clamp(min=0)], 0)
            words[torch.arange(gb.numel()), j // 32] |= 1 << (j % 32)
            anc[gb, j] = words
            cu = torch.zeros(uniq.numel() + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(sizes, 0)
            i32 = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
            mask = _Frontier(cu.to(dev), i32.to(dev), int(sizes.max()))
            rr = row_of[uniq]
            logits = self._forward(s.token[gb, gs].to(dev), (Lt[row_of[gb]] - 1 + d).to(dev), Lt[rr].to(dev),
                                   table[rr.to(dev)], mask, int((Lt[rr] + count[uniq]).max()),
                                   kv_pos=(Lt[row_of[gb]] + j).to(dev), num_keys=count[uniq].to(torch.int32).to(dev))
            p, t = self._topk(logits)
            probs[go], toks[go], rows[go] = p[:, :c].cpu(), t[:, :c].cpu(), j
            return probs, toks, rows

        return expand
