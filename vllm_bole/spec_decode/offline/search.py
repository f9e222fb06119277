"""Offline best-first variants (tests, benchmarks), on the runtime's search
(:func:`vllm_bole.spec_decode.best_first.grow`, whose docstring states the algorithm and its
optimality): from a one-pass drafter's dense ``marginals [B, D, V]`` (:func:`build_best_first`),
batch-wide (:func:`build_best_first_batch`), and from an autoregressive drafter expanded level by
level (:func:`build_best_first_autoregressive`: the children of a frontier node are the top-``top_k``
tokens of ``step_fn``'s distribution; ``beam`` optionally limits the depth-``d`` nodes expanded per
request, EAGLE-2 style). All return a :class:`DraftTree` (deterministic children).
"""
from __future__ import annotations

import torch

from vllm_bole.spec_decode.best_first import Slots, budgets, grow
from vllm_bole.spec_decode.offline.trees import CHILDREN_DETERMINISTIC, DraftTree, Frontier, StepFn, as_tokens, \
    call_step, check_drafter
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES

__all__ = ["build_best_first", "build_best_first_autoregressive", "build_best_first_batch"]


def _draft_tree(s: Slots, table: torch.Tensor | None, with_rows: bool) -> DraftTree:
    return DraftTree(
        tree=s.tree(),
        draft_probs=s.flat("qprob"),
        scores=s.flat("logrho").exp(),
        children=CHILDREN_DETERMINISTIC,
        child_dist_table=table,
        child_dist_index=s.flat("row") if with_rows else None,
        source_ids=s.flat("nid"),
    )


def build_best_first(
    root_tokens: torch.Tensor,
    marginals: torch.Tensor,
    budget,
    *,
    max_depth: int | None = None,
    top_k: int | None = None,
    total_budget: int | None = None,
) -> DraftTree:
    """BASTION / DDTree best-first tree from a one-pass drafter's dense marginals.

    ``marginals``: ``[B, D, V]`` probabilities (``marginals[b, k]`` for depth ``k + 1``).
    ``budget``: draft nodes per request (int or ``[B]``). ``max_depth``: defaults to ``D``.
    ``top_k``: children considered per node (default ``min(max budget, V)``: exact).
    ``total_budget``: optional cap on the draft nodes of the whole batch (batch-wide
    best-first). Maximises ``sum rho``. The runtime form over ``[B, D, K]`` candidates is
    :func:`vllm_bole.spec_decode.best_first.best_first_tree`.
    """
    root = as_tokens(root_tokens)
    B = root.numel()
    check_drafter(marginals, None, B)
    device = marginals.device
    root = root.to(device)
    caps = budgets(budget, B, device)
    D, V = marginals.shape[1], marginals.shape[2]
    L = min(D if max_depth is None else int(max_depth), D, MAX_DEPTH)
    c = min(int(caps.max()) if top_k is None else int(top_k), V)
    if c <= 0 or L <= 0:
        L = 0
        top_v = top_i = None
    else:
        top_v, top_i = marginals.topk(c, dim=-1)  # [B, D, c]

    def expand(fb, fs, d, _slots):
        return top_v[fb, d], top_i[fb, d], fb * D + d

    s = grow(root, expand, caps, L, total_budget=total_budget)
    return _draft_tree(s, marginals.reshape(-1, V), True)


def build_best_first_batch(
    root_tokens: torch.Tensor,
    marginals: torch.Tensor,
    total_budget: int,
    *,
    max_per_request=None,
    max_depth: int | None = None,
    top_k: int | None = None,
) -> DraftTree:
    """Batch-wide best-first: one global selection over all requests, ``total_budget`` draft
    nodes in all, at most ``max_per_request`` (int or ``[B]``; default ``min(total_budget,
    MAX_NODES - 1)``) per request. Ragged result; maximises the batch's ``sum rho``."""
    if max_per_request is None:
        max_per_request = min(int(total_budget), MAX_NODES - 1)
    return build_best_first(
        root_tokens, marginals, max_per_request, max_depth=max_depth, top_k=top_k, total_budget=int(total_budget)
    )


def _frontier(s: Slots, fb: torch.Tensor, fs: torch.Tensor, d: int) -> Frontier:
    """The frontier ``(request, slot)`` pairs of depth ``d`` with their root-first path tokens."""
    path = torch.empty(fb.numel(), d + 1, dtype=torch.long, device=fb.device)
    cur = fs
    for k in range(d, -1, -1):  # walk up the parents: one gather per level
        path[:, k] = s.token[fb, cur]
        cur = s.parent[fb, cur].clamp(min=0)
    par = s.parent[fb, fs]
    return Frontier(
        request=fb,
        node_id=s.nid[fb, fs],
        parent_id=torch.where(par >= 0, s.nid[fb, par.clamp(min=0)], torch.full_like(par, -1)),
        token=s.token[fb, fs],
        depth=d,
        path_tokens=path,
    )


def build_best_first_autoregressive(
    root_tokens: torch.Tensor,
    step_fn: StepFn,
    budget,
    *,
    max_depth: int,
    top_k: int | None = None,
    beam: int | None = None,
    total_budget: int | None = None,
    keep_dists: bool = True,
) -> DraftTree:
    """Best-first tree from an autoregressive drafter expanded level by level.

    At depth ``d`` the drafter is called once on the frontier (the depth-``d`` nodes of the
    current top-``budget`` set, or only the ``beam`` best of them per request); each frontier
    node proposes its top-``top_k`` tokens (default ``min(max budget, V)``); the pool is
    reranked globally to the budget (per request, and batch-wide with ``total_budget``).
    ``keep_dists`` keeps the drafter's output rows as ``child_dist_table``.
    """
    root = as_tokens(root_tokens)
    B = root.numel()
    device = root.device
    caps = budgets(budget, B, device)
    L = min(int(max_depth), MAX_DEPTH)
    tables: list[torch.Tensor] = []
    n_rows = [0]

    def expand(fb, fs, d, slots):
        fr = _frontier(slots, fb, fs, d)
        probs = call_step(step_fn, fr)
        c = min(int(caps.max()) if top_k is None else int(top_k), probs.shape[1])
        v, t = probs.topk(c, dim=-1)
        rows = None
        if keep_dists:
            rows = n_rows[0] + torch.arange(fr.size, device=probs.device)
            tables.append(probs)
            n_rows[0] += fr.size
        return v, t, rows

    s = grow(root, expand, caps, L, total_budget=total_budget, beam=beam)
    table = (torch.cat(tables, 0) if tables else None) if keep_dists else None
    return _draft_tree(s, table, keep_dists)
