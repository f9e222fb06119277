"""Draft trees, drafters, the best-first builder and lossless verification (engine-agnostic: torch only).

One decode step's tree path, as the tree runner calls it::

    cands = drafter.propose(histories, depths)                  # Candidates [B, D, K]   (candidates.py)
    tree = best_first_tree(roots, cands, budget, max_depth=D)   # TreeBatch               (best_first.py)
    drafts = tree.draft_token_ids()                             # list[list[int]] for vLLM's scheduler
    ...next step: tree.select(rows, num_nodes).to(device)       # the scheduled requests and drafts
    res = verify_greedy(tree, logits)  /  verify_deterministic(...)   # (verification.py)

Drafters: :class:`~.ngram.NgramDrafter` (prompt lookup), :class:`~.draft_model.HFDraftModel`.
Sampling helpers (target distribution, inverse-CDF draws): :mod:`.sampling`. Offline tree tools
(static / Sequoia / sampled trees, dense and autoregressive best-first): :mod:`.offline`.
"""
from vllm_bole.spec_decode.best_first import best_first_tree
from vllm_bole.spec_decode.candidates import Candidates, Drafter
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES, TreeBatch, TreeError

__all__ = ["MAX_DEPTH", "MAX_NODES", "Candidates", "Drafter", "TreeBatch", "TreeError", "best_first_tree"]
