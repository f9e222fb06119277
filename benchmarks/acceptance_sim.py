"""Pure logic of the acceptance benchmark (no model, no data): greedy acceptance of a draft tree
against a known target continuation, the decoding walk, k-ary templates, calibration statistics
and sparse-to-dense candidate compaction. Tested in ``tests/test_acceptance_sim.py``.

Greedy verification descends into the child whose token is the target's argmax at the current
node and stops where no child matches; the target's argmax along the accepted path is exactly its
own greedy continuation. So, for a target continuation ``ref`` known in advance (one greedy run),
the number of draft tokens a tree accepts is the depth of the deepest node whose root-to-node path
spells ``ref[0..depth-1]`` -- the same number ``verify(..., mode="greedy")`` returns minus the
bonus token (checked in the tests).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from vllm_bole.spec_decode.builders import StaticTree
from vllm_bole.spec_decode.tree import TreeBatch

__all__ = [
    "accepted_lengths",
    "compact_candidates",
    "conditioned_observations",
    "kary_template",
    "rank_of",
    "walk",
]


def accepted_lengths(tree: TreeBatch, node_tokens: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest root-to-node path matching the reference, per request.

    ``node_tokens [T]``: the token of every flat node in the reference's id space (``-1``: never
    matches, e.g. a padding node of zero draft probability; the roots' entries are ignored).
    ``reference [B, H]``: ``reference[b, d - 1]`` is the target's token at depth ``d`` after
    request ``b``'s root (``-1`` beyond the known continuation). Returns ``(accepted [B] int64,
    flat index of the deepest accepted node [B])``; ties between equal-token siblings go to the
    first, as greedy verification does.
    """
    B, H = reference.shape
    depth = tree.depth.long()
    req = tree.request_index
    ref = reference[req, (depth - 1).clamp(min=0, max=max(H - 1, 0))] if H > 0 else torch.full_like(depth, -1)
    ok = (depth == 0) | ((depth <= H) & (ref >= 0) & (node_tokens.long() == ref))
    path = tree.path_flat  # [T, L + 1], -1 beyond the node's depth
    path_ok = torch.where(path >= 0, ok[path.clamp(min=0)], torch.ones_like(path, dtype=torch.bool)).all(1)
    T = depth.numel()
    # deepest fully matching node; first in flat order among equals (key: depth * T - index)
    key = torch.where(path_ok, depth * (T + 1) + (T - torch.arange(T)), torch.full_like(depth, -1))
    best = torch.full((B,), -1, dtype=torch.long).scatter_reduce_(0, req, key, "amax")
    node = T - (best % (T + 1))
    return best // (T + 1), node


def walk(lengths: Sequence[int], accept_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Simulated speculative decoding over ``P`` prompts, batched across prompts.

    Prompt ``p``'s target continuation has ``lengths[p]`` tokens ``c_1..c_L``; ``c_1`` comes from
    the prefill, so decoding starts with ``t = 1`` emitted tokens. A step at ``t`` (root ``c_t``)
    accepts ``a = accept_fn(prompts, t)`` draft tokens and emits ``a + 1`` (the bonus), so
    ``t <- t + a + 1``; steps run while ``t < L``. ``accept_fn(prompt_ids [n], t [n]) -> [n]`` is
    called once per round for all prompts still decoding. Returns ``(steps [P], accepted [P])``.
    """
    L = torch.as_tensor(list(lengths), dtype=torch.long)
    P = L.numel()
    t = torch.ones(P, dtype=torch.long)
    steps = torch.zeros(P, dtype=torch.long)
    acc = torch.zeros(P, dtype=torch.long)
    while True:
        live = torch.nonzero(t < L).flatten()
        if live.numel() == 0:
            break
        a = torch.as_tensor(accept_fn(live, t[live])).long()
        if a.shape != live.shape or (a < 0).any():
            raise ValueError("accept_fn must return one non-negative count per live prompt")
        steps[live] += 1
        acc[live] += a
        t[live] += a + 1
    return steps, acc


def kary_template(k: int, budget: int) -> StaticTree:
    """The first ``budget`` draft nodes, in breadth-first order, of the infinite ``k``-ary tree
    (every node's children take ranks ``0..k-1``): a complete ``k``-ary tree of exactly
    ``budget`` draft nodes (``k = 1`` is the chain)."""
    if k < 1 or budget < 0:
        raise ValueError("need k >= 1 and budget >= 0")
    parents = [-1] + [(i - 1) // k for i in range(1, budget + 1)]
    ranks = [0] + [(i - 1) % k for i in range(1, budget + 1)]
    return StaticTree(tuple(parents), tuple(ranks))


def rank_of(cand_tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank of ``target [...]`` among ``cand_tokens [..., K]`` (sorted best first, ``-1``
    padding): its index, or ``-1`` if absent."""
    hit = (cand_tokens == target[..., None]) & (cand_tokens >= 0)
    idx = hit.long().argmax(-1)
    return torch.where(hit.any(-1), idx, torch.full_like(idx, -1))


def conditioned_observations(ranks: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Observations for :func:`~vllm_bole.spec_decode.builders.acceptance_stats` from
    teacher-forced ranks ``[S, D]`` (``ranks[s, d - 1]``: rank of the target's token at depth
    ``d`` of sample ``s`` in the drafter's distribution after the true path; ``-1``: absent or
    unknown). The observation at depth ``d`` is kept only when every shallower true token has a
    rank in ``[0, num_ranks)``, i.e. when its parent can be accepted in a tree whose children use
    those ranks (the table's conditioning: P(rank-r child accepted | parent accepted)). Samples
    whose continuation is unknown at a depth must be cut there by the caller (pass ``-2``):
    ``-2`` entries are dropped and stop the sample."""
    S, D = ranks.shape
    known = ranks != -2
    good = (ranks >= 0) & (ranks < num_ranks)
    prefix_good = torch.cat([torch.ones(S, 1, dtype=torch.bool), good.long().cumprod(1).bool()[:, :-1]], 1)
    prefix_known = known.long().cumprod(1).bool()
    keep = prefix_good & prefix_known
    s, d = torch.nonzero(keep, as_tuple=True)
    return d + 1, ranks[s, d]


def compact_candidates(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense marginals over a compact vocabulary from sparse candidates ``[B, D, K]`` (``-1``
    padding): returns ``(marginals [B, D, U + 1], table [U + 1])`` with ``table[u]`` the real
    token of compact id ``u`` and id 0 reserved for "no token" (``table[0] = -1``, zero mass).
    Builders only rank tokens, so a tree built on the compact ids maps back through ``table``."""
    real = tokens[tokens >= 0]
    uniq = torch.unique(real)
    table = torch.cat([torch.full((1,), -1, dtype=torch.long), uniq])
    ids = torch.searchsorted(uniq, tokens.clamp(min=0)) + 1
    ids = torch.where(tokens >= 0, ids, torch.zeros_like(ids))
    marg = torch.zeros(*tokens.shape[:-1], table.numel(), dtype=torch.float32)
    marg.scatter_add_(-1, ids, torch.where(tokens >= 0, probs.float(), torch.zeros_like(probs.float())))
    marg[..., 0] = 0.0
    return marg, table
