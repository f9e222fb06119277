"""The adapter's old import path (``from vllm_bole.spec_decode.drafters import HFDraftModel,
build_draft_trees``), kept until ``vllm_bole.adapter.runner`` calls the new API; then delete this
module. New code: ``Drafter.propose`` (:mod:`.candidates`, :mod:`.ngram`, :mod:`.draft_model`) ->
:func:`vllm_bole.spec_decode.best_first.best_first_tree` -> ``TreeBatch.select`` /
``TreeBatch.draft_token_ids``.
"""
from __future__ import annotations

from typing import Sequence

from vllm_bole.spec_decode.best_first import best_first_tree
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.draft_model import HFDraftModel

__all__ = ["HFDraftModel", "build_draft_trees"]


def build_draft_trees(
    roots: Sequence[int], cands: Candidates, budget, *, max_depth: int, top_k: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """:func:`best_first_tree` as per-request ``(parents, tokens)`` of the draft nodes (local
    indices, root = 0 excluded, topological order; empty lists without candidates)."""
    tree = best_first_tree(roots, cands, budget, max_depth=max_depth, top_k=top_k)
    par, tok, cu = tree.parent.tolist(), tree.token_ids.tolist(), tree.cu_nodes.tolist()
    return [(par[s + 1 : e], tok[s + 1 : e]) for s, e in zip(cu[:-1], cu[1:])]
