"""The paged draft model drafting trees node by node: every node's children come from the draft's
distribution after that node's own path, not from one candidate row per depth of the greedy chain.

Best-first search (:func:`~vllm_bole.spec_decode.best_first.grow` with ``beam``, the runtime builder's
search, calibration included) with the draft as its expansion: after the step's first forward (the
roots' children, as the chain drafter's), each depth level's ``beam`` best frontier nodes of every
request go through ONE draft forward. Their queries attend to the history and, through
``tree_attention``'s ``num_keys``, to the request's earlier expanded nodes by ancestor bits (an expanded
node: its parent's bits and its own).

In the step (:meth:`PagedTreeDraftModel._levels`, issue 16 item 1): fixed shapes, the search on the
device in the packed state of :func:`~vllm_bole.spec_decode.best_first.level_search_packed`
(:func:`~vllm_bole.spec_decode.best_first.packed_level`), so the whole drafting (first forward,
``depth - 1`` levels of ``B * beam`` tokens, the search) is ONE CUDA graph replay per batch bucket, as
the chain drafter's step; level ``d``'s lane ``i`` is expansion row ``j = (d - 1) * beam + i``, its K/V at
position ``len(history) + j``; a request with fewer frontier nodes than ``beam`` (or past its own depth)
computes junk rows that write to the trash page and get no children. Outside what the step searches (a
budget over ``max_budget``, a smaller ``top_k``, a search wider than ``SEARCH_WIDTH``) the host runs the
same search (:meth:`PagedTreeDraftModel._host_trees`), one eager forward per level of the frontier nodes
alone (rows ``j`` in expansion order). The pages hold ``len(history) + beam * (depth - 1)`` tokens per
request; the tree's K/V are scratch, as the chain's.

Measured offline (``benchmarks/acceptance_quality.py``, a draft head on SmolLM2-135M): drafting
node by node accepts 9% more tokens per step than the same draft's chain candidates at 32 nodes,
16% at 64. It costs ``depth - 1`` draft forwards of ``beam`` tokens per request (the chain: one
token). Engine-agnostic; ``draft_beam`` in the engine config selects it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_bole.spec_decode.best_first import (PACKED_FIELDS, S_DEP, S_LOG, S_PAR, S_TOK, Slots, free_slots, grow,
                                              packed_children, packed_level, packed_trees, search_state)
from vllm_bole.spec_decode.paged_draft import WORDS, PagedDraftModel
from vllm_bole.spec_decode.tree import MAX_NODES, int32_words

__all__ = ["PagedTreeDraftModel"]


@dataclass
class _Frontier:
    """tree_attention's view of one level's frontier: query rows per request and their ancestor bits
    over the request's expanded nodes."""

    cu_nodes: torch.Tensor  # [R + 1] int32
    anc_mask: torch.Tensor  # [F, WORDS] int32
    max_nodes: int


class PagedTreeDraftModel(PagedDraftModel):
    """A :class:`~vllm_bole.spec_decode.candidates.TreeDrafter` (:meth:`grow_trees` /
    :meth:`grow_trees_async`, arguments as :class:`PagedDraftModel`'s, plus ``beam``: frontier nodes
    expanded per request and depth)."""

    def __init__(self, *args, beam: int = 4, **kwargs):
        depth = int(kwargs["depth"])
        if not 1 <= beam or beam * max(depth - 1, 1) > MAX_NODES:
            raise ValueError(f"draft_beam: {beam} must be >= 1 with draft_beam * (max_depth - 1) <= {MAX_NODES}")
        self.beam = int(beam)
        super().__init__(*args, **kwargs)

    @property
    def runtime(self) -> str:
        return f"{super().runtime}, trees node by node, {self.beam} frontier nodes per depth"

    def _scratch(self) -> int:
        return max(self.depth + 1, self.beam * max(self.depth - 1, 0) + 1)

    def _extra(self, D: int, W: int) -> int:
        return W + max(D, self.beam * max(D - 1, 0) + 1)

    def _outputs(self, B: int, steps: int, search: bool) -> dict:
        """With ``search`` the trees alone (searched level by level, :meth:`_levels`: no per-depth top-k
        and no chain steps); without it the chain's outputs."""
        if not search:
            return super()._outputs(B, steps, search)
        return dict(tree=torch.zeros(B, self.slots, len(PACKED_FIELDS), dtype=torch.float64, device=self.device))

    def _graphs_answer(self, search: dict | None) -> bool:
        """The step graphs search trees node by node; :meth:`propose`'s chain candidates (the warm-up's) run
        eagerly."""
        return search is not None or not self.device_search

    def _step(self, bufs: dict, steps: int, max_kv_len: int) -> None:
        """The graph body: with the search's buffers, :meth:`_first` (the roots' children), then ``steps``
        levels node by node (:meth:`_levels`) into ``tree``; without them the chain's step."""
        if "tree" not in bufs:
            return super()._step(bufs, steps, max_kv_len)
        p, t = self._first(bufs, max_kv_len)
        bufs["tree"].copy_(self._levels(bufs, p, t, steps, max_kv_len))

    def _levels(self, bufs: dict, p: torch.Tensor, t: torch.Tensor, levels: int, max_kv_len: int) -> torch.Tensor:
        """:func:`~vllm_bole.spec_decode.best_first.grow` with ``beam`` and the draft as its expansion, with
        fixed shapes and no host synchronisation (the step's CUDA graph): ``p`` / ``t`` [B, top_k] the roots'
        children; then per level ``d`` = 1 .. ``levels`` every row's ``beam`` best depth-``d`` nodes (by
        score, then slot: grow's beam) in ONE forward of ``B * beam`` tokens, each at KV position
        ``L + (d - 1) * beam + i`` (``L``: the row's cached tokens, the root last) and attending to the history
        and, by ancestor bits, to the row's nodes expanded before it (``num_keys`` ``d * beam``); rows with
        fewer frontier nodes, or at their own depth (``dep``), write to the trash page and get no children.
        Returns ``[B, slots, PACKED_FIELDS]`` (the search state carries each node's expansion row, the
        index of its ancestor bits in ``anc``)."""
        B, dev, S, w, c = p.shape[0], p.device, self.slots, self.beam, self.top_k
        ROW = 6
        L, dep, table, cal = bufs["start"] + bufs["count"], bufs["dep"], bufs["table"], bufs["cal"]
        st = search_state(bufs["root"], S, extra=1)
        keep_n, free = (bufs["caps"] + 1)[:, None], free_slots(st)
        first = torch.where((dep > 0)[:, None], p[:, :c], 0.0)[:, None]
        st = packed_level(st, packed_children(st, torch.zeros_like(dep)[:, None], t[:, None, :c], first, 1, cal),
                          keep_n, free)
        slot_ids, lanes = torch.arange(S, device=dev).expand(B, S), torch.arange(w, device=dev)
        word = torch.arange(WORDS, device=dev)
        anc = torch.zeros(B, w * max(levels, 1), WORDS, dtype=torch.int64, device=dev)  # ancestor bits by row
        cu = (torch.arange(B + 1, device=dev) * w).to(torch.int32)
        for d in range(1, levels + 1):
            front = st[..., S_DEP] == d
            order = torch.where(front, -st[..., S_LOG], math.inf).sort(dim=1, stable=True).indices
            chosen = front & (torch.empty_like(order).scatter_(1, order, slot_ids) < w)
            at = torch.where(chosen, chosen.cumsum(1) - 1, w)
            fslot = torch.zeros(B, w + 1, dtype=torch.long, device=dev).scatter_(1, at, slot_ids)[:, :w]  # slot order
            live = (lanes < chosen.sum(1, keepdim=True)) & (d < dep)[:, None]
            j = (d - 1) * w + lanes  # [w] expansion rows
            prow = st[..., ROW].gather(1, st[..., S_PAR].gather(1, fslot).long().clamp(min=0)).long()  # -1: the root
            bits = torch.where(word == (j // 32)[:, None], 1 << (j % 32)[:, None], 0)  # [w, WORDS]
            words = torch.where((prow >= 0)[..., None], anc.gather(1, prow.clamp(min=0)[..., None].expand(B, w, WORDS)),
                                0) | bits
            anc[:, j] = words
            st[..., ROW] = st[..., ROW].scatter(1, fslot, torch.where(live, j.double(), st[..., ROW].gather(1, fslot)))
            kv = torch.where(live, L[:, None] + j, 0)
            slots = torch.where(live, self._slots(table, kv), 0)  # dead rows: the trash page
            mask = _Frontier(cu, int32_words(words).view(B * w, WORDS), w)
            logits = self._forward(st[..., S_TOK].gather(1, fslot).long().flatten(),
                                   (L - 1 + d)[:, None].expand(B, w).flatten(), L, table, mask, max_kv_len,
                                   num_keys=torch.where(d < dep, d * w, 0).to(torch.int32), slots=slots.flatten())
            pc, tc = (x.view(B, w, -1)[..., :c] for x in self._topk(logits))
            st = packed_level(st, packed_children(st, fslot, tc, torch.where(live[..., None], pc, 0.0), d + 1, cal),
                              keep_n, free)
        return packed_trees(st)

    def _host_trees(self, roots, histories: Sequence, depths: Sequence[int], caps: torch.Tensor, *, keys,
                    max_depth: int, top_k: int | None, calibration: torch.Tensor | None) -> Slots:
        """The trees searched on the host (what the step cannot search): :func:`grow` with :meth:`_expander`,
        one eager forward per level."""
        B = len(histories)
        D = min(max((int(d) for d in depths), default=0), int(max_depth), self.depth)
        c = min(int(top_k or self.top_k), self.top_k)
        keys, temp, dep, live, hists = self._admit(histories, [min(int(d), D) for d in depths], keys,
                                                   self._extra(D, 0))
        caps = caps.clone()
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
            mask = _Frontier(cu.to(dev), int32_words(words).to(dev), int(sizes.max()))
            rr = row_of[uniq]
            logits = self._forward(s.token[gb, gs].to(dev), (Lt[row_of[gb]] - 1 + d).to(dev), Lt[rr].to(dev),
                                   table[rr.to(dev)], mask, int((Lt[rr] + count[uniq]).max()),
                                   kv_pos=(Lt[row_of[gb]] + j).to(dev), num_keys=count[uniq].to(torch.int32).to(dev))
            p, t = self._topk(logits)
            probs[go], toks[go], rows[go] = p[:, :c].cpu(), t[:, :c].cpu(), j
            return probs, toks, rows

        return expand
