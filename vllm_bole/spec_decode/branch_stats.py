"""Where trees pay: acceptance of the main path (the drafter's first-child chain from the root)
against acceptance of the siblings, per depth. A node is *reached* when its parent was accepted
(so its own acceptance is the conditional rate the tree builder's scores estimate); the counts
add up over steps, so the rates come out as accepted / reached."""
from __future__ import annotations

import torch

from vllm_bole.spec_decode.tree import MAX_DEPTH, TreeBatch
from vllm_bole.spec_decode.verification import VerificationResult

COLUMNS = ("main_reached", "main_accepted", "sibling_reached", "sibling_accepted")


def branch_counts(tree: TreeBatch, result: VerificationResult) -> torch.Tensor:
    """``[MAX_DEPTH + 1, 4]`` int64 counts (:data:`COLUMNS`) per depth of the draft nodes of
    ``tree`` under the verification ``result`` (row 0, the roots, stays zero)."""
    T, dev = tree.num_nodes, tree.token_ids.device
    parent = tree.parent_flat
    idx = torch.arange(T, device=dev)
    # first child: the lowest index among its parent's children (children are in decreasing probability)
    first = torch.full((T,), T, dtype=torch.long, device=dev)
    has_parent = parent >= 0
    first.scatter_reduce_(0, parent[has_parent], idx[has_parent], reduce="amin")
    is_first = has_parent & (first[parent.clamp(min=0)] == idx)
    main = ~has_parent  # roots
    depth = tree.depth.long()
    for d in range(1, tree.max_depth + 1):  # breadth-first: a parent's flag is final before its children's
        at = depth == d
        main = torch.where(at, is_first & main[parent.clamp(min=0)], main)
    accepted = torch.zeros(T, dtype=torch.bool, device=dev)
    loc = result.accepted_nodes.to(dev)
    start = tree.cu_nodes[:-1].long().to(dev)[:, None].expand_as(loc)
    ok = loc >= 0
    accepted[(loc + start)[ok]] = True
    reached = has_parent & accepted[parent.clamp(min=0)]
    cols = torch.stack([reached & main, accepted & has_parent & main, reached & ~main, accepted & has_parent & ~main], 1)
    out = torch.zeros(MAX_DEPTH + 1, 4, dtype=torch.long, device=dev)
    out.index_add_(0, depth, cols.long())
    return out.cpu()
