"""Where trees pay, measured, and fed back into the tree builder.

Kinds of draft node, by place in a best-first tree (children in decreasing draft probability, so a
node's first child is its drafter's top candidate):

* ``MAIN``: on the first-child chain from the root (the drafter's greedy chain);
* ``BRANCH``: a later child of a root or MAIN node (the drafter's alternatives at that position);
* ``OFF``: any child of a BRANCH or OFF node. Chain and one-pass drafters propose one candidate
  row per depth, conditioned on the main chain's context (or on none), so these nodes continue a
  context their candidates were not proposed for.

:func:`kind_counts` counts per (depth, kind), over verified trees: nodes *reached* (parent
accepted), *accepted*, and the *expected* acceptances (sum of the reached nodes' draft
probabilities). A reached node's acceptance is the conditional rate the builder's path scores
(``rho``, products of draft probabilities) estimate; ``accepted / expected`` says how far off they
are. :class:`Calibration` keeps these counts (halving a bucket's when its expectation passes
:data:`MEMORY`, so recent behaviour dominates) and gives the builder a factor per (depth, kind),
``f = (accepted + PRIOR) / (expected + PRIOR)`` (1 before any data): the builder scores a child by
``min(f q, 1)`` instead of ``q`` (:func:`~vllm_bole.spec_decode.best_first.best_first_slots`), so
the tree's ``sum rho`` estimates the accepted tokens as measured: a long main path where siblings
fail, wide shallow levels where the drafter's second choices succeed. Lossless either way: only
the trees' shapes change.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_bole.spec_decode.tree import MAX_DEPTH, TreeBatch
from vllm_bole.transfer import host_array

__all__ = ["KINDS", "BRANCH_COLUMNS", "Calibration", "branch_columns", "kind_counts", "node_kinds"]

KINDS = ("main", "branch", "off")
MAIN, BRANCH, OFF = range(3)
COUNTS = ("reached", "accepted", "expected")
BRANCH_COLUMNS = ("main_reached", "main_accepted", "sibling_reached", "sibling_accepted")
PRIOR = 4.0  # pseudo-observations at factor 1 per bucket
MEMORY = 4096.0  # a bucket's counts halve when its expected acceptances pass this


def node_kinds(tree: TreeBatch) -> torch.Tensor:
    """``[T]`` int64 kind of every node (:data:`KINDS` index; roots ``MAIN``): the builder's
    (``tree.node_kind``), else from the tree's structure."""
    if tree.node_kind is not None:
        return tree.node_kind.long()
    T, dev = tree.num_nodes, tree.token_ids.device
    parent = tree.parent_flat
    idx = torch.arange(T, device=dev)
    first = torch.full((T,), T, dtype=torch.long, device=dev)
    has_parent = parent >= 0
    first.scatter_reduce_(0, parent[has_parent], idx[has_parent], reduce="amin")
    is_first = has_parent & (first[parent.clamp(min=0)] == idx)
    kind = torch.full((T,), MAIN, dtype=torch.long, device=dev)
    depth = tree.depth.long()
    for d in range(1, tree.max_depth + 1):  # breadth-first: a parent's kind is final before its children's
        at = depth == d
        pk = kind[parent.clamp(min=0)]
        child = torch.where(pk == MAIN, torch.where(is_first, MAIN, BRANCH), OFF)
        kind = torch.where(at, child, kind)
    return kind


def kind_counts(tree: TreeBatch, accepted_nodes: torch.Tensor) -> torch.Tensor:
    """``[MAX_DEPTH + 1, 3 kinds, 3]`` float64 (:data:`COUNTS`: reached, accepted, expected) of the
    draft nodes of ``tree`` (placeholders, token -1, are none; row 0, the roots, stays zero) under
    ``accepted_nodes`` ``[B, L + 1]`` (local indices, root first, -1 padded). ``expected`` needs ``tree.draft_prob`` (else zero). On the
    host in numpy (the runner counts every tree step's host tree: ~15 torch operations were 60 us)."""
    host = host_array  # a host tree: views, no copy
    T = tree.num_nodes
    cu = host(tree.cu_nodes).astype(np.int64)
    local = host(tree.parent).astype(np.int64)
    parent = np.where(local >= 0, local + np.repeat(cu[:-1], np.diff(cu)), -1)
    loc = host(accepted_nodes).astype(np.int64)
    accepted = np.zeros(T, dtype=bool)
    accepted[(loc + cu[:-1, None])[loc >= 0]] = True
    draft = (parent >= 0) & (host(tree.token_ids) >= 0)  # placeholder children (token -1) are no drafts
    reached = draft & accepted[np.maximum(parent, 0)]
    bucket = host(tree.depth).astype(np.int64) * len(KINDS) + host(node_kinds(tree))
    size = (MAX_DEPTH + 1) * len(KINDS)
    out = np.zeros((size, len(COUNTS)))
    out[:, 0] = np.bincount(bucket, weights=reached, minlength=size)
    out[:, 1] = np.bincount(bucket, weights=accepted & draft, minlength=size)
    if tree.draft_prob is not None:
        out[:, 2] = np.bincount(bucket, weights=np.where(reached, host(tree.draft_prob), 0.0), minlength=size)
    return torch.from_numpy(out).view(MAX_DEPTH + 1, len(KINDS), len(COUNTS))


def branch_columns(counts: torch.Tensor) -> torch.Tensor:
    """:data:`BRANCH_COLUMNS` per depth (main path against its siblings and their subtrees) from
    :func:`kind_counts` ``[MAX_DEPTH + 1, 3, 3]``: ``[MAX_DEPTH + 1, 4]`` int64."""
    main, side = counts[:, MAIN], counts[:, BRANCH] + counts[:, OFF]
    return torch.stack([main[:, 0], main[:, 1], side[:, 0], side[:, 1]], 1).round().long()


class Calibration:
    """Decaying per (depth, kind) counts of verified trees and the builder's factors (module docstring)."""

    def __init__(self):
        self.counts = torch.zeros(MAX_DEPTH + 1, len(KINDS), len(COUNTS), dtype=torch.float64)
        self._factors: torch.Tensor | None = None

    def update(self, counts: torch.Tensor) -> None:
        """Add one step's :func:`kind_counts` (on the host, in numpy: a step's host work)."""
        c = self.counts.numpy()
        c += counts.numpy()
        c[c[..., 2] > MEMORY] *= 0.5
        self._factors = None

    def factors(self) -> torch.Tensor:
        """``[MAX_DEPTH + 1, 3]`` float32 factors ``(accepted + PRIOR) / (expected + PRIOR)`` (row d:
        nodes at depth d); computed once per update (read-only)."""
        if self._factors is None:
            c = self.counts.numpy()
            self._factors = torch.from_numpy(((c[..., 1] + PRIOR) / (c[..., 2] + PRIOR)).astype(np.float32))
        return self._factors

    def rates(self, max_depth: int) -> dict:
        """Per kind, depths 1..``max_depth``: measured acceptance rate (accepted / reached, None
        where nothing was reached) and the calibration factor (JSON-ready)."""
        c, f = self.counts, self.factors()
        out = {}
        for k, name in enumerate(KINDS):
            reached = c[1: max_depth + 1, k, 0]
            out[name] = dict(
                reached=[round(float(x), 1) for x in reached],
                rate=[round(float(a / r), 4) if r > 0 else None for a, r in zip(c[1: max_depth + 1, k, 1], reached)],
                factor=[round(float(x), 4) for x in f[1: max_depth + 1, k]])
        return out
