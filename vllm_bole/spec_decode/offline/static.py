"""Static draft-tree templates (chain, complete k-ary, Sequoia-optimal) and the positional
acceptance statistics Sequoia's dynamic programme optimises (offline tools).

A :class:`StaticTree` is a template of parents and *ranks* (rank ``r`` = the ``r``-th best token
of the parent's draft distribution, or its ``r``-th draw for sampled children), shared by all
requests. :func:`optimal_static_tree` is Sequoia's dynamic programme over positional acceptance
probabilities ``p[d, r]`` (probability that the rank-``r`` child of an accepted node at depth
``d - 1`` is the accepted one), maximising the expected number of emitted tokens
``sum_v prod_{u in path(v)} p[depth(u), rank(u)]`` (root counted as 1) for a node budget and a
depth limit, with children occupying consecutive ranks ``0..k-1``. ``O(D * K * N^2)`` work,
vectorised over the budget axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES, TreeBatch, TreeError

__all__ = ["StaticTree", "acceptance_stats", "expected_tokens", "optimal_static_tree"]


@dataclass(frozen=True)
class StaticTree:
    """A tree template shared by all requests: local ``parents`` (root -1, ``parents[i] < i``)
    and ``ranks`` (which of the parent's candidate tokens the node takes: the ``r``-th best for
    top-k instantiation, the ``r``-th draw for sampled children). Sibling ranks are distinct.
    ``expected`` is the objective value when the template came from :func:`optimal_static_tree`.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    expected: float | None = None

    def __post_init__(self):
        p, r = tuple(int(x) for x in self.parents), tuple(int(x) for x in self.ranks)
        object.__setattr__(self, "parents", p)
        object.__setattr__(self, "ranks", r)
        if len(p) == 0 or p[0] != -1:
            raise TreeError("StaticTree.parents: node 0 must be the root (parent -1)")
        if len(r) != len(p):
            raise TreeError(f"StaticTree.ranks: {len(r)} ranks for {len(p)} nodes")
        if len(p) > MAX_NODES:
            raise TreeError(f"StaticTree: {len(p)} nodes, over the limit of {MAX_NODES}")
        seen = set()
        for i in range(1, len(p)):
            if not 0 <= p[i] < i:
                raise TreeError(f"StaticTree.parents[{i}] = {p[i]}: need 0 <= parent < {i} (topological order)")
            if r[i] < 0 or (p[i], r[i]) in seen:
                raise TreeError(f"StaticTree.ranks[{i}] = {r[i]}: sibling ranks must be distinct and >= 0")
            seen.add((p[i], r[i]))
        if self.max_depth > MAX_DEPTH:
            raise TreeError(f"StaticTree: depth {self.max_depth} over the limit of {MAX_DEPTH}")

    # -------------------------------------------------------------------------- templates
    @classmethod
    def chain(cls, depth: int) -> "StaticTree":
        """A chain of ``depth`` draft tokens (the top-1 token at every depth)."""
        if depth < 0:
            raise ValueError("depth must be >= 0")
        return cls(tuple(range(-1, depth)), (0,) * (depth + 1))

    @classmethod
    def full(cls, branching: Sequence[int]) -> "StaticTree":
        """Full tree with ``branching[d]`` children (ranks ``0..k-1``) under every node of depth
        ``d``, numbered breadth first."""
        parents, ranks = [-1], [0]
        level = [0]
        for k in branching:
            if int(k) < 0:
                raise ValueError("branching factors must be >= 0")
            nxt = []
            for node in level:
                for r in range(int(k)):
                    parents.append(node)
                    ranks.append(r)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def kary(cls, k: int, budget: int) -> "StaticTree":
        """The first ``budget`` draft nodes, in breadth-first order, of the infinite ``k``-ary tree
        (every node's children take ranks ``0..k-1``): a complete ``k``-ary tree of exactly
        ``budget`` draft nodes (``k = 1`` is the chain)."""
        if k < 1 or budget < 0:
            raise ValueError("need k >= 1 and budget >= 0")
        parents = [-1] + [(i - 1) // k for i in range(1, budget + 1)]
        ranks = [0] + [(i - 1) % k for i in range(1, budget + 1)]
        return cls(tuple(parents), tuple(ranks))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def budget(self) -> int:
        return len(self.parents) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def contiguous_ranks(self) -> bool:
        """Whether the children of every node have ranks exactly ``0..k-1``."""
        kids: dict[int, list[int]] = {}
        for i in range(1, len(self.parents)):
            kids.setdefault(self.parents[i], []).append(self.ranks[i])
        return all(sorted(v) == list(range(len(v))) for v in kids.values())

    def tree(self, root_token: int = 0) -> TreeBatch:
        """The template as a one-request :class:`TreeBatch` (tokens = ranks, root = ``root_token``)."""
        toks = [int(root_token)] + list(self.ranks[1:])
        return TreeBatch.from_parents([list(self.parents)], [toks])


# ------------------------------------------------------------------------------ Sequoia
def _accept_table(accept_probs, max_depth: int | None, budget: int) -> torch.Tensor:
    p = torch.as_tensor(accept_probs, dtype=torch.float64).cpu()
    if p.dim() == 1:
        D = budget if max_depth is None else int(max_depth)
        p = p[None, :].expand(max(D, 0), -1)
    elif p.dim() == 2:
        if max_depth is not None:
            if max_depth > p.shape[0]:
                raise ValueError(f"max_depth {max_depth} but accept_probs has only {p.shape[0]} depth rows")
            p = p[: int(max_depth)]
    else:
        raise ValueError("accept_probs: expected [K] (per rank) or [D, K] (per depth, rank)")
    if (p < 0).any() or (p > 1).any():
        raise ValueError("accept_probs: probabilities must lie in [0, 1]")
    return p.contiguous()


def expected_tokens(template: StaticTree, accept_probs) -> float:
    """Expected emitted tokens per step of ``template`` under positional acceptance
    probabilities (``[K]`` per rank or ``[D, K]`` per depth and rank; row ``d - 1`` = depth
    ``d``; ranks beyond ``K`` or depths beyond ``D`` accept with probability 0)."""
    p = torch.as_tensor(accept_probs, dtype=torch.float64).cpu()
    if p.dim() == 1:
        p = p[None, :].expand(max(template.max_depth, 1), -1)
    f = [1.0] * template.num_nodes
    for i, (par, r, d) in enumerate(zip(template.parents, template.ranks, template.depths)):
        if i == 0:
            continue
        pr = float(p[d - 1, r]) if d - 1 < p.shape[0] and r < p.shape[1] else 0.0
        f[i] = f[par] * pr
    return float(sum(f))


def optimal_static_tree(accept_probs, budget: int, max_depth: int | None = None) -> StaticTree:
    """Sequoia's optimal static tree: the prefix-closed tree of at most ``budget`` draft nodes
    and depth ``<= max_depth`` (children at consecutive ranks) maximising :func:`expected_tokens`.

    ``accept_probs``: ``[K]`` per rank (same at every depth; ``max_depth`` defaults to
    ``budget``) or ``[D, K]`` per (depth, rank) (``max_depth`` defaults to ``D``).

    DP (``V_d(n)`` = best value of a subtree rooted at depth ``d`` using at most ``n`` nodes,
    normalised so its root counts 1; ``G_d(m, r)`` = best value of the children of ranks
    ``>= r`` using at most ``m`` nodes):
    ``V_D(n) = 1``, ``V_d(n) = 1 + G_d(n - 1, 0)``,
    ``G_d(m, r) = max(0, max_{1<=j<=m} p[d, r] V_{d+1}(j) + G_d(m - j, r + 1))``.
    """
    budget = int(budget)
    if not 0 <= budget <= MAX_NODES - 1:
        raise ValueError(f"budget must be in [0, {MAX_NODES - 1}]")
    p = _accept_table(accept_probs, max_depth, budget)
    D = min(p.shape[0], budget, MAX_DEPTH)
    K = min(p.shape[1], budget)
    N = budget + 1
    if D == 0 or K == 0:
        return StaticTree((-1,), (0,), 1.0)
    m_idx = torch.arange(N + 1)[:, None]
    j_idx = torch.arange(N + 1)[None, :]
    ok = (j_idx >= 1) & (j_idx <= m_idx)
    diff = (m_idx - j_idx).clamp(min=0)
    V = [None] * (D + 1)
    V[D] = torch.ones(N + 1, dtype=torch.float64)
    V[D][0] = 0.0
    choice: list[list[torch.Tensor]] = [[] for _ in range(D)]
    neg = torch.tensor(-math.inf, dtype=torch.float64)
    for d in range(D - 1, -1, -1):
        G = torch.zeros(N + 1, dtype=torch.float64)
        ch = [None] * K
        for r in range(K - 1, -1, -1):
            A = torch.where(ok, p[d, r] * V[d + 1][j_idx.expand(N + 1, -1)] + G[diff], neg)
            A[:, 0] = 0.0  # stop: no child at rank r (nor after)
            G, ch[r] = A.max(dim=1)
        choice[d] = ch
        Vd = torch.zeros(N + 1, dtype=torch.float64)
        Vd[1:] = 1.0 + G[:-1]
        V[d] = Vd

    parents, ranks = [-1], [0]

    def grow(node: int, d: int, n: int):  # offline reconstruction (template, not hot path)
        if d >= D:
            return
        m = n - 1
        kids = []
        for r in range(K):
            j = int(choice[d][r][m])
            if j == 0:
                break
            kids.append((r, j))
            m -= j
        for r, j in kids:
            parents.append(node)
            ranks.append(r)
            grow(len(parents) - 1, d + 1, j)

    grow(0, 0, N)
    # breadth-first renumbering, children in rank order
    order = [0]
    kids_of: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        kids_of.setdefault(parents[i], []).append(i)
    q = 0
    while q < len(order):
        order.extend(sorted(kids_of.get(order[q], []), key=lambda i: ranks[i]))
        q += 1
    new = {old: k for k, old in enumerate(order)}
    bp = tuple(-1 if parents[o] < 0 else new[parents[o]] for o in order)
    br = tuple(ranks[o] for o in order)
    return StaticTree(bp, br, float(V[0][N]))


def acceptance_stats(depths: torch.Tensor, ranks: torch.Tensor, num_ranks: int, max_depth: int) -> torch.Tensor:
    """Positional acceptance table ``[max_depth, num_ranks]`` from logged observations.

    Each observation is one verified position whose parent was accepted: ``depths`` (>= 1) is
    its depth and ``ranks`` the rank, in the drafter's sorted distribution at that position, of
    the token the target accepted/emitted there (-1 or ``>= num_ranks``: not among the ranks).
    ``p[d - 1, r] = #(depth d, rank r) / #(depth d)``; depths without observations get zeros.
    """
    depths = torch.as_tensor(depths).long().flatten().cpu()
    ranks = torch.as_tensor(ranks).long().flatten().cpu()
    ok = (depths >= 1) & (depths <= max_depth)
    depths, ranks = depths[ok], ranks[ok]
    tot = torch.bincount(depths - 1, minlength=max_depth).double()
    hit = (ranks >= 0) & (ranks < num_ranks)
    cnt = torch.zeros(max_depth * num_ranks, dtype=torch.float64)
    cnt.index_add_(0, (depths[hit] - 1) * num_ranks + ranks[hit], torch.ones(int(hit.sum()), dtype=torch.float64))
    return cnt.view(max_depth, num_ranks) / tot.clamp(min=1)[:, None]
