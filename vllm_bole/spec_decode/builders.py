"""Draft-tree builders: static (chain, k-ary, Sequoia-optimal), best-first (BASTION / DDTree)
from a one-pass drafter, best-first from an autoregressive drafter, batch-wide best-first, and
sampled-children trees for recursive rejection sampling. Engine-agnostic: torch only.

Every builder returns a :class:`DraftTree`: a :class:`TreeBatch` plus the per-node metadata
verification needs.

Conventions and design decisions
--------------------------------
* **Budget** = number of *draft* nodes per request, the root excluded (a tree has ``budget + 1``
  nodes, at most ``MAX_NODES``). ``total_budget`` caps the draft nodes of the whole batch.
* **One-pass drafter** (BASTION / DFlash style): ``marginals[b, k]`` (``[B, D, V]``, probabilities)
  is the distribution of the draft token at depth ``k + 1``; the children of *any* node at depth
  ``d`` come from ``marginals[b, d]``, so siblings always carry distinct tokens.
* **Autoregressive drafter**: a callable ``step_fn(frontier) -> [F, V]`` probabilities of the next
  token for each frontier node (:class:`Frontier`: request, node ids, depth, root-first path
  tokens). Trees grow level by level; every call sees nodes of one depth only.
* **Scores**: ``rho(i) = prod of draft probabilities along the root-to-i path`` (root 1). The sum
  of ``rho`` over a tree is BASTION's estimate of the expected number of accepted tokens (+1).
  Selection works in float64 log space; ``scores`` holds ``exp`` of it.
* **Best-first** keeps, after each depth level ``d``, the top-``budget`` nodes (by ``rho``) of the
  tree truncated at depth ``d``; the next level only expands the depth-``d`` nodes of that set.
  This equals the classic priority-queue best-first expansion (always add the frontier node of
  largest ``rho``) because (i) ``rho`` never increases along a path, so the top-N set of any
  prefix-closed candidate family is prefix-closed, and (ii) a node outside the top-N of the
  depth-``d`` truncation can never re-enter (adding deeper candidates only pushes it down).
  Ties are broken by (rho desc, breadth-first position asc), a strict total order in which a
  parent always precedes its children, so the result is prefix-closed even with ties (q = 1
  tokens, underflow). Result: the tree maximises ``sum rho`` among all prefix-closed trees of
  ``<= budget`` draft nodes, depth ``<= max_depth``, children among each node's ``top_k`` tokens
  (exact when ``top_k >= budget``, the default). Cost per level: one sort of
  ``[B, (N + 1) * (1 + top_k)]``; a loop over depth levels only.
* **Autoregressive best-first** is the same algorithm with the children of a frontier node taken
  from the top-``top_k`` tokens of ``step_fn``'s distribution; ``beam`` optionally limits how many
  depth-``d`` nodes per request are expanded (EAGLE-2 style); the final tree is always the global
  rerank (top-``budget`` by ``rho``) of everything generated. With ``beam=None`` and
  ``top_k >= budget`` it is exactly optimal, like the one-pass version.
* **Batch-wide** best-first: one global selection over all requests with a total budget and
  per-request caps (greedy over a laminar matroid, hence optimal for ``sum rho``); order
  (rho desc, request asc, position asc). The per-level pruning argument still holds because the
  greedy acceptance count before any node can only drop when candidates are removed.
* **Static trees** (:class:`StaticTree`): a template of parents and *ranks* (rank ``r`` = the
  ``r``-th best token of the parent's draft distribution), shared by all requests.
  :func:`optimal_static_tree` is Sequoia's dynamic programme over positional acceptance
  probabilities ``p[d, r]`` (probability that the rank-``r`` child of an accepted node at depth
  ``d - 1`` is the accepted one), maximising the expected number of emitted tokens
  ``sum_v prod_{u in path(v)} p[depth(u), rank(u)]`` (root counted as 1) for a node budget and a
  depth limit, with children occupying consecutive ranks ``0..k-1``. ``O(D * K * N^2)`` work,
  vectorised over the budget axis; offline.
* **Sampled children** (:func:`build_sampled`): the template's shape, but the ``r``-th child of a
  node is the ``r``-th draw from the parent's draft distribution ``q``: i.i.d. draws
  (``replacement=True``, SpecInfer; duplicate tokens stay separate siblings) or draws without
  replacement (Sequoia; if ``q`` has fewer than ``k`` tokens of positive mass the missing children
  and their subtrees are dropped, giving ragged trees). Siblings are stored in draw order, which
  is the order verification tries them in. Sampling uses one uniform per draw (inverse CDF over
  ``cumsum(q)``; without replacement, removed intervals are skipped by shifting the uniform), so
  no ``[F, V]`` random tensors are needed for a one-pass drafter.
* **Children kinds** (``DraftTree.children``): ``"deterministic"`` (top-k / static / best-first)
  must be verified by sampling from the target and matching children; rejection sampling is
  lossless only for ``"with_replacement"`` / ``"without_replacement"`` trees, whose per-node draft
  distribution is kept as ``child_dist_table[child_dist_index[i]]`` (``[R, V]`` rows, shared rows
  for a one-pass drafter: ``row = b * D + depth``).
* Trees are built through ``TreeBatch.from_flat`` (validated, CPU) and moved to the input device;
  a static template whose nodes all survive is tiled from one validated tree (no per-batch
  validation), which keeps 1e5-request batches cheap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch

from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES, TreeBatch, TreeError

__all__ = [
    "CHILDREN_DETERMINISTIC",
    "CHILDREN_WITH_REPLACEMENT",
    "CHILDREN_WITHOUT_REPLACEMENT",
    "DraftTree",
    "Frontier",
    "StaticTree",
    "StepFn",
    "acceptance_stats",
    "build_best_first",
    "build_best_first_autoregressive",
    "build_best_first_batch",
    "build_sampled",
    "build_static",
    "chain_tree",
    "expected_tokens",
    "kary_tree",
    "optimal_static_tree",
]

CHILDREN_DETERMINISTIC = "deterministic"
CHILDREN_WITH_REPLACEMENT = "with_replacement"
CHILDREN_WITHOUT_REPLACEMENT = "without_replacement"
_CHILDREN_KINDS = (CHILDREN_DETERMINISTIC, CHILDREN_WITH_REPLACEMENT, CHILDREN_WITHOUT_REPLACEMENT)


# ---------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees plus what verification needs.

    ``draft_probs[i]``: probability of node ``i``'s token under the distribution its parent's
    children were drawn from (1 for roots). ``scores[i]``: ``rho(i)``, product of ``draft_probs``
    along the path (float64; 1 for roots). ``children``: how siblings were chosen (see module
    docstring). ``child_dist_table[child_dist_index[i]]`` is the draft distribution of node
    ``i``'s children (``-1``: not recorded / leaf). ``source_ids[i]``: the node's id in the
    builder (template index for static trees, the ``Frontier.node_id`` for best-first trees),
    for drafters that keep per-node state.
    """

    tree: TreeBatch
    draft_probs: torch.Tensor  # [T] float32
    scores: torch.Tensor  # [T] float64
    children: str = CHILDREN_DETERMINISTIC
    child_dist_table: torch.Tensor | None = None  # [R, V]
    child_dist_index: torch.Tensor | None = None  # [T] int64
    source_ids: torch.Tensor | None = None  # [T] int64

    def __post_init__(self):
        if self.children not in _CHILDREN_KINDS:
            raise ValueError(f"children: {self.children!r}, expected one of {_CHILDREN_KINDS}")

    @property
    def num_requests(self) -> int:
        return self.tree.num_requests

    def child_dists(self) -> torch.Tensor:
        """``[T, V]`` draft distribution of each node's children (zero rows where unknown)."""
        if self.child_dist_table is None or self.child_dist_index is None:
            raise ValueError("this draft tree carries no child distributions")
        idx = self.child_dist_index
        rows = self.child_dist_table[idx.clamp(min=0)]
        return torch.where((idx >= 0)[:, None], rows, torch.zeros_like(rows))

    def expected_accepted(self) -> torch.Tensor:
        """``[B]`` float64: sum of ``rho`` over draft nodes (the root excluded)."""
        B = self.tree.num_requests
        req = self.tree.request_index.to(self.scores.device)
        tot = torch.zeros(B, dtype=torch.float64, device=self.scores.device).index_add_(0, req, self.scores)
        return tot - 1.0


@dataclass(frozen=True)
class Frontier:
    """Nodes handed to an autoregressive drafter (all of depth ``depth``).

    ``node_id`` / ``parent_id`` are ids unique within a request and stable for the whole build
    (the root is 0; ``parent_id`` is -1 for roots); ``path_tokens`` is ``[F, depth + 1]``, root
    token first, the node's own token last.
    """

    request: torch.Tensor  # [F] int64
    node_id: torch.Tensor  # [F] int64
    parent_id: torch.Tensor  # [F] int64
    token: torch.Tensor  # [F] int64
    depth: int
    path_tokens: torch.Tensor  # [F, depth + 1] int64

    @property
    def size(self) -> int:
        return self.request.numel()


StepFn = Callable[[Frontier], torch.Tensor]  # -> [F, V] next-token probabilities


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


# ------------------------------------------------------------------------------ static trees
def chain_tree(depth: int) -> StaticTree:
    """A chain of ``depth`` draft tokens (the top-1 token at every depth)."""
    if depth < 0:
        raise ValueError("depth must be >= 0")
    return StaticTree(tuple(range(-1, depth)), (0,) * (depth + 1))


def kary_tree(branching: Sequence[int]) -> StaticTree:
    """Full tree with ``branching[d]`` children (ranks ``0..k-1``) under every node of depth ``d``,
    numbered breadth first."""
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
    return StaticTree(tuple(parents), tuple(ranks))


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


# ----------------------------------------------------------------------------------- sampling
def _last_positive(probs: torch.Tensor) -> torch.Tensor:
    V = probs.shape[-1]
    return V - 1 - (probs > 0).flip(-1).int().argmax(-1)


def _inverse_cdf(probs: torch.Tensor, cdf: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Token ``t`` with ``cdf[t - 1] <= y < cdf[t]`` per row (``y`` ``[R, n]`` in cdf units).
    Zero-probability tokens are never returned (clamped to the last positive token)."""
    t = torch.searchsorted(cdf, y.to(cdf.dtype).contiguous(), right=True)
    return torch.minimum(t, _last_positive(probs)[:, None])


def _sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: ``probs`` ``[R, V]`` (unnormalised ok), ``u`` ``[R]`` or ``[R, n]``
    uniforms in [0, 1); returns int64 tokens of ``u``'s shape."""
    squeeze = u.dim() == 1
    u2 = u[:, None] if squeeze else u
    p = probs.float()
    cdf = p.cumsum(-1)
    t = _inverse_cdf(p, cdf, u2.float() * cdf[:, -1:])
    return t[:, 0] if squeeze else t


def _sample_rows_without_replacement(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` ``[R, V]``, ``u`` ``[R, E, k]``: for every ``(r, e)`` an independent sequence of
    ``k`` draws without replacement from row ``r`` (draw ``j`` ~ ``probs`` with the earlier draws
    removed, renormalised). Returns tokens ``[R, E, k]`` and ``ok`` (False when the row's
    positive mass is exhausted, or a float corner case would repeat a token)."""
    R, E, k = u.shape
    p = probs.float()
    cdf = p.cumsum(-1)  # [R, V]
    total = cdf[:, -1]  # [R]
    last = _last_positive(p)  # [R]
    tok = torch.zeros(R, E, k, dtype=torch.long, device=p.device)
    ok = torch.ones(R, E, k, dtype=torch.bool, device=p.device)
    starts = torch.zeros(R, E, 0, dtype=p.dtype, device=p.device)
    masses = torch.zeros(R, E, 0, dtype=p.dtype, device=p.device)
    rows = torch.arange(R, device=p.device)[:, None].expand(R, E)
    for j in range(k):
        remaining = total[:, None] - masses.sum(-1)  # [R, E]
        y = u[:, :, j].to(p.dtype) * remaining
        if j:
            s_sorted, order = starts.sort(-1)
            m_sorted = masses.gather(-1, order)
            for i in range(j):  # skip removed intervals in increasing position
                y = y + torch.where(s_sorted[:, :, i] <= y, m_sorted[:, :, i], torch.zeros_like(y))
        t = torch.searchsorted(cdf, y.reshape(R, E).contiguous(), right=True)
        t = torch.minimum(t, last[:, None])
        q_t = p[rows, t]
        good = (remaining > 0) & (q_t > 0)
        if j:
            good &= (tok[:, :, :j] != t[:, :, None]).all(-1)
        tok[:, :, j] = t
        ok[:, :, j] = good
        mass = torch.where(good, q_t, torch.zeros_like(q_t))
        starts = torch.cat([starts, (cdf[rows, t] - q_t)[:, :, None]], -1)
        masses = torch.cat([masses, mass[:, :, None]], -1)
    ok = ok.int().cumprod(-1).bool()  # after a failed draw the sequence stops
    return tok, ok


def _rand(shape, generator: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    if generator is None:
        return torch.rand(shape, device=device, dtype=dtype)
    return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


# ------------------------------------------------------------------------------- finalisation
def _as_tokens(root_tokens) -> torch.Tensor:
    t = torch.as_tensor(root_tokens)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError("root_tokens: expected a non-empty 1-D tensor [B]")
    return t.long()


def _tile(t: TreeBatch, token: torch.Tensor) -> TreeBatch | None:
    """``B`` copies of the one-request tree ``t`` with per-request tokens ``[B, M]``: per-node
    tensors are repeated, host-side fields copied; None if a field cannot be tiled that way."""
    B, M = token.shape
    kw = {}
    for f in fields(TreeBatch):
        v = getattr(t, f.name)
        if f.name == "token_ids":
            kw[f.name] = token.reshape(-1).to(v.device, v.dtype)
        elif f.name == "cu_nodes":
            kw[f.name] = torch.arange(B + 1, dtype=v.dtype) * M
        elif isinstance(v, torch.Tensor):
            if v.dim() == 0 or v.shape[0] != M:
                return None
            kw[f.name] = v.repeat(B, *([1] * (v.dim() - 1)))
        else:
            kw[f.name] = v  # host-side per-tree scalars (e.g. the largest tree size) are unchanged
    return TreeBatch(**kw)


def _finalize(
    token: torch.Tensor,
    parent: torch.Tensor,
    valid: torch.Tensor,
    extras: dict[str, torch.Tensor],
    template_tree: TreeBatch | None = None,
) -> tuple[TreeBatch, dict[str, torch.Tensor]]:
    """Compact ``[B, M]`` slot arrays (topological order per row, ``valid`` prefix-closed) into
    a TreeBatch on ``token``'s device, plus the flat extras."""
    B, M = token.shape
    device = token.device
    if template_tree is not None and bool(valid.all()):
        tree = _tile(template_tree, token)
        if tree is not None:
            return tree.to(device), {k: v.reshape(-1) for k, v in extras.items()}
    newidx = valid.long().cumsum(1) - 1
    newpar = torch.where(parent >= 0, newidx.gather(1, parent.clamp(min=0)), torch.full_like(parent, -1))
    flat = valid.reshape(-1)
    counts = valid.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.long, device=device)
    cu[1:] = counts.cumsum(0)
    tree = TreeBatch.from_flat(newpar.reshape(-1)[flat], token.reshape(-1)[flat], cu).to(device)
    return tree, {k: v.reshape(-1)[flat] for k, v in extras.items()}


# ---------------------------------------------------------------------- template instantiation
def _check_drafter(marginals, step_fn, B: int):
    if (marginals is None) == (step_fn is None):
        raise ValueError("give exactly one of marginals (one-pass drafter) or step_fn (autoregressive drafter)")
    if marginals is not None:
        if marginals.dim() != 3 or marginals.shape[0] != B:
            raise ValueError(f"marginals: expected [B={B}, D, V], got {tuple(marginals.shape)}")


def _call_step(step_fn: StepFn, fr: Frontier) -> torch.Tensor:
    probs = step_fn(fr)
    if probs.dim() != 2 or probs.shape[0] != fr.size:
        raise ValueError(f"step_fn: expected [{fr.size}, V] probabilities, got {tuple(probs.shape)}")
    return probs


def _from_template(template: StaticTree, root_tokens, marginals, step_fn, mode: str, generator, keep_dists: bool):
    """mode: 'topk' | 'with' | 'without'."""
    root = _as_tokens(root_tokens)
    B = root.numel()
    _check_drafter(marginals, step_fn, B)
    device = marginals.device if marginals is not None else root.device
    root = root.to(device)
    if mode != "topk" and not template.contiguous_ranks:
        raise ValueError("sampled children need sibling ranks 0..k-1 (draw order)")
    ttree = template.tree()
    M = template.num_nodes
    tpath = ttree.path.long().to(device)
    par = torch.tensor(template.parents, dtype=torch.long, device=device)
    rk = torch.tensor(template.ranks, dtype=torch.long, device=device)
    token = torch.zeros(B, M, dtype=torch.long, device=device)
    token[:, 0] = root
    valid = torch.zeros(B, M, dtype=torch.bool, device=device)
    valid[:, 0] = True
    qprob = torch.ones(B, M, dtype=torch.float32, device=device)
    logrho = torch.zeros(B, M, dtype=torch.float64, device=device)
    row = torch.full((B, M), -1, dtype=torch.long, device=device)
    tables: list[torch.Tensor] = []
    n_rows = 0
    if marginals is not None:
        D, V = marginals.shape[1], marginals.shape[2]
        if template.max_depth > D:
            raise ValueError(f"template depth {template.max_depth} exceeds the drafter's {D} marginals")
        if mode == "topk" and M > 1:
            kmax = min(max(template.ranks[1:]) + 1, V)
            top_v, top_i = marginals.topk(kmax, dim=-1)  # [B, D, kmax]
    bidx = torch.arange(B, device=device)
    depths = template.depths
    for d in range(template.max_depth):
        # the level's structure comes from the (host-side) template: no device sync
        kid_list = [i for i in range(M) if depths[i] == d + 1]
        exp_list = sorted({template.parents[i] for i in kid_list})
        E = len(exp_list)
        k = max(template.ranks[i] for i in kid_list) + 1
        pos = {j: e for e, j in enumerate(exp_list)}
        kids = torch.tensor(kid_list, dtype=torch.long, device=device)
        kpar, krank = par[kids], rk[kids]
        expanders = torch.tensor(exp_list, dtype=torch.long, device=device)
        ke = torch.tensor([pos[template.parents[i]] for i in kid_list], dtype=torch.long, device=device)
        fmask = valid[:, expanders]  # [B, E]
        if not bool(fmask.any()):
            break
        g_tok = torch.zeros(B, E, k, dtype=torch.long, device=device)
        g_q = torch.zeros(B, E, k, dtype=torch.float32, device=device)
        g_ok = torch.zeros(B, E, k, dtype=torch.bool, device=device)
        if marginals is not None:
            q_rows = marginals[:, d]  # [B, V] children of any depth-d node
            if mode == "topk":
                kk = min(k, top_v.shape[-1])
                g_tok[:, :, :kk] = top_i[:, d, None, :kk]
                g_q[:, :, :kk] = top_v[:, d, None, :kk].float()
                g_ok[:, :, :kk] = True
            else:
                u = _rand((B, E, k), generator, device, torch.float64)
                if mode == "with":
                    t = _sample_rows(q_rows, u.reshape(B, E * k)).view(B, E, k)
                    okk = torch.ones_like(t, dtype=torch.bool)
                else:
                    t, okk = _sample_rows_without_replacement(q_rows, u)
                g_tok, g_ok = t, okk
                g_q = q_rows.float().gather(1, t.reshape(B, -1)).view(B, E, k)
            row[:, expanders] = torch.where(fmask, (bidx * D + d)[:, None], row[:, expanders])
        else:
            fb, fe = fmask.nonzero(as_tuple=True)
            fj = expanders[fe]
            fr = Frontier(
                request=fb,
                node_id=fj,
                parent_id=par[fj],
                token=token[fb, fj],
                depth=d,
                path_tokens=token[fb[:, None], tpath[fj, : d + 1]],
            )
            probs = _call_step(step_fn, fr)
            F, V = probs.shape
            if mode == "topk":
                kk = min(k, V)
                v, t = probs.topk(kk, dim=-1)
                okk = torch.ones_like(t, dtype=torch.bool)
                if kk < k:
                    pad = k - kk
                    v = torch.cat([v, v.new_zeros(F, pad)], 1)
                    t = torch.cat([t, t.new_zeros(F, pad)], 1)
                    okk = torch.cat([okk, okk.new_zeros(F, pad)], 1)
            else:
                u = _rand((F, 1, k), generator, device, torch.float64)
                if mode == "with":
                    t = _sample_rows(probs, u[:, 0])
                    okk = torch.ones_like(t, dtype=torch.bool)
                else:
                    t, okk = _sample_rows_without_replacement(probs, u)
                    t, okk = t[:, 0], okk[:, 0]
                v = probs.float().gather(1, t)
            g_tok[fb, fe], g_q[fb, fe], g_ok[fb, fe] = t, v.float(), okk
            if keep_dists:
                row[fb, fj] = n_rows + torch.arange(F, device=device)
                tables.append(probs)
                n_rows += F
        sel = (slice(None), ke, krank)  # ke: expander position of each kid's parent
        kt, kq, kok = g_tok[sel], g_q[sel], g_ok[sel] & valid[:, kpar]
        token[:, kids] = torch.where(kok, kt, torch.zeros_like(kt))
        valid[:, kids] = kok
        qprob[:, kids] = torch.where(kok, kq, torch.zeros_like(kq))
        logrho[:, kids] = torch.where(kok, logrho[:, kpar] + kq.double().log(), torch.full_like(logrho[:, kpar], -math.inf))
    parent = par[None, :].expand(B, M)
    src = torch.arange(M, device=device)[None, :].expand(B, M)
    tree, ex = _finalize(token, parent, valid, {"q": qprob, "lr": logrho, "row": row, "src": src}, ttree)
    if marginals is not None:
        table = marginals.reshape(-1, marginals.shape[-1])
    else:
        table = torch.cat(tables, 0) if tables else None
    keep = marginals is not None or keep_dists
    children = {"topk": CHILDREN_DETERMINISTIC, "with": CHILDREN_WITH_REPLACEMENT,
                "without": CHILDREN_WITHOUT_REPLACEMENT}[mode]
    return DraftTree(
        tree=tree,
        draft_probs=ex["q"],
        scores=ex["lr"].exp(),
        children=children,
        child_dist_table=table if keep else None,
        child_dist_index=ex["row"] if keep else None,
        source_ids=ex["src"],
    )


def build_static(
    template: StaticTree,
    root_tokens: torch.Tensor,
    *,
    marginals: torch.Tensor | None = None,
    step_fn: StepFn | None = None,
    keep_dists: bool = True,
) -> DraftTree:
    """Instantiate a static template (chain, k-ary, Sequoia-optimal): the node of rank ``r``
    under a node of depth ``d`` takes the ``r``-th most probable token of its parent's draft
    distribution (``marginals[b, d]`` for a one-pass drafter, ``step_fn`` output for an
    autoregressive one, called once per depth level). Children are deterministic."""
    return _from_template(template, root_tokens, marginals, step_fn, "topk", None, keep_dists)


def build_sampled(
    template: StaticTree,
    root_tokens: torch.Tensor,
    *,
    marginals: torch.Tensor | None = None,
    step_fn: StepFn | None = None,
    replacement: bool = True,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Template shape with *sampled* children for recursive rejection sampling: the ``r``-th
    child of a node is the ``r``-th draw from the node's draft distribution, i.i.d.
    (``replacement=True``, SpecInfer) or without replacement (Sequoia; exhausted draws are
    dropped with their subtrees). The draft distributions are kept for verification."""
    mode = "with" if replacement else "without"
    return _from_template(template, root_tokens, marginals, step_fn, mode, generator, True)


# --------------------------------------------------------------------------------- best-first
def _select(cand_log: torch.Tensor, cand_valid: torch.Tensor, slots: torch.Tensor, total_budget: int | None):
    """Keep mask ``[B, M]``: per request the ``slots[b]`` best candidates by (logrho desc,
    position asc); with ``total_budget``, then the globally best ``total_budget`` non-root
    candidates by (logrho desc, request asc, position asc). Position 0 is the root."""
    B, M = cand_log.shape
    key = torch.where(cand_valid, -cand_log, torch.full_like(cand_log, math.inf))
    order = torch.sort(key, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(M, device=key.device)[None, :].expand(B, M))
    keep = cand_valid & (rank < slots[:, None])
    if total_budget is not None:
        nonroot = keep.clone()
        nonroot[:, 0] = False
        flat = torch.where(nonroot, key, torch.full_like(key, math.inf)).reshape(-1)
        g = torch.sort(flat, stable=True).indices
        cnt = nonroot.reshape(-1)[g].long().cumsum(0)
        ok = torch.empty_like(nonroot.reshape(-1))
        ok[g] = cnt <= int(total_budget)
        keep = nonroot & ok.view(B, M)
        keep[:, 0] = cand_valid[:, 0]
    return keep


def _best_first(root, expand, caps: torch.Tensor, total_budget, max_depth: int, beam: int | None):
    """Level-wise exact best-first (see module docstring). ``expand(frontier)`` returns
    ``(probs [F, c], tokens [F, c], dist_rows [F] or None)`` for the candidate children."""
    device = root.device
    B = root.numel()
    S = int(caps.max()) + 1
    L = max_depth
    valid = torch.zeros(B, S, dtype=torch.bool, device=device)
    valid[:, 0] = True
    token = torch.zeros(B, S, dtype=torch.long, device=device)
    token[:, 0] = root
    parent = torch.full((B, S), -1, dtype=torch.long, device=device)
    depth = torch.zeros(B, S, dtype=torch.long, device=device)
    logrho = torch.full((B, S), -math.inf, dtype=torch.float64, device=device)
    logrho[:, 0] = 0.0
    qprob = torch.ones(B, S, dtype=torch.float32, device=device)
    row = torch.full((B, S), -1, dtype=torch.long, device=device)
    nid = torch.zeros(B, S, dtype=torch.long, device=device)
    paths = torch.zeros(B, S, L + 1, dtype=torch.long, device=device)
    paths[:, 0, 0] = root
    next_id = 1
    slots = caps + 1
    for d in range(L):
        if S == 1:
            break
        front = valid & (depth == d) & (caps > 0)[:, None]
        if beam is not None:
            key = torch.where(front, -logrho, torch.full_like(logrho, math.inf))
            order = torch.sort(key, dim=1, stable=True).indices
            rnk = torch.empty_like(order)
            rnk.scatter_(1, order, torch.arange(S, device=device)[None, :].expand(B, S))
            front = front & (rnk < int(beam))
        fb, fs = front.nonzero(as_tuple=True)
        F = fb.numel()
        if F == 0:
            break
        fpar = parent[fb, fs]
        fr = Frontier(
            request=fb,
            node_id=nid[fb, fs],
            parent_id=torch.where(fpar >= 0, nid[fb, fpar.clamp(min=0)], torch.full_like(fpar, -1)),
            token=token[fb, fs],
            depth=d,
            path_tokens=paths[fb, fs, : d + 1],
        )
        vals, toks, rows = expand(fr)
        c = vals.shape[1]
        if rows is not None:
            row[fb, fs] = rows
        ctok = torch.zeros(B, S, c, dtype=torch.long, device=device)
        ctok[fb, fs] = toks
        cq = torch.zeros(B, S, c, dtype=torch.float32, device=device)
        cq[fb, fs] = vals.float()
        cvalid = torch.zeros(B, S, c, dtype=torch.bool, device=device)
        cvalid[fb, fs] = vals > 0
        clog = torch.full((B, S, c), -math.inf, dtype=torch.float64, device=device)
        clog[fb, fs] = logrho[fb, fs, None] + vals.double().log()
        clog = torch.where(cvalid, clog, torch.full_like(clog, -math.inf))
        cand_log = torch.cat([logrho, clog.reshape(B, S * c)], 1)
        cand_valid = torch.cat([valid, cvalid.reshape(B, S * c)], 1)
        keep = _select(cand_log, cand_valid, slots, total_budget)
        # compaction (kept candidates keep their breadth-first order)
        src = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :S]
        nvalid = torch.arange(S, device=device)[None, :] < keep.sum(1, keepdim=True)
        newpos = keep.long().cumsum(1) - 1
        is_old = src < S
        oslot = src.clamp(max=S - 1)
        cpos = (src - S).clamp(min=0)
        cslot = cpos // c
        n_token = torch.where(is_old, token.gather(1, oslot), ctok.reshape(B, -1).gather(1, cpos))
        p_old = torch.where(is_old, parent.gather(1, oslot), cslot)
        n_parent = torch.where(p_old >= 0, newpos.gather(1, p_old.clamp(min=0)), torch.full_like(p_old, -1))
        n_depth = torch.where(is_old, depth.gather(1, oslot), torch.full_like(oslot, d + 1))
        n_log = torch.where(is_old, logrho.gather(1, oslot), clog.reshape(B, -1).gather(1, cpos))
        n_q = torch.where(is_old, qprob.gather(1, oslot), cq.reshape(B, -1).gather(1, cpos))
        n_row = torch.where(is_old, row.gather(1, oslot), torch.full_like(oslot, -1))
        n_nid = torch.where(is_old, nid.gather(1, oslot), next_id + cpos)
        n_paths = paths.gather(1, torch.where(is_old, oslot, cslot)[:, :, None].expand(B, S, L + 1)).clone()
        n_paths[:, :, d + 1] = torch.where(is_old, n_paths[:, :, d + 1], n_token)
        next_id += S * c
        valid = nvalid
        token = torch.where(nvalid, n_token, torch.zeros_like(n_token))
        parent = torch.where(nvalid, n_parent, torch.full_like(n_parent, -1))
        depth = torch.where(nvalid, n_depth, torch.zeros_like(n_depth))
        logrho = torch.where(nvalid, n_log, torch.full_like(n_log, -math.inf))
        qprob = torch.where(nvalid, n_q, torch.zeros_like(n_q))
        row, nid, paths = n_row, n_nid, n_paths
    tree, ex = _finalize(token, parent, valid, {"q": qprob, "lr": logrho, "row": row, "nid": nid})
    return tree, ex


def _caps(budget, B: int, device) -> torch.Tensor:
    caps = torch.as_tensor(budget, dtype=torch.long).to(device)
    if caps.dim() == 0:
        caps = caps.expand(B).clone()
    if caps.shape != (B,):
        raise ValueError(f"budget: expected an int or a [B={B}] tensor, got shape {tuple(caps.shape)}")
    if (caps < 0).any() or (caps > MAX_NODES - 1).any():
        raise ValueError(f"budget: per-request draft nodes must lie in [0, {MAX_NODES - 1}]")
    return caps


def build_best_first(
    root_tokens: torch.Tensor,
    marginals: torch.Tensor,
    budget,
    *,
    max_depth: int | None = None,
    top_k: int | None = None,
    total_budget: int | None = None,
) -> DraftTree:
    """BASTION / DDTree best-first tree from a one-pass drafter.

    ``marginals``: ``[B, D, V]`` probabilities (``marginals[b, k]`` for depth ``k + 1``).
    ``budget``: draft nodes per request (int or ``[B]``). ``max_depth``: defaults to ``D``.
    ``top_k``: children considered per node (default ``min(max budget, V)``: exact).
    ``total_budget``: optional cap on the draft nodes of the whole batch (batch-wide
    best-first). Maximises ``sum rho`` (see module docstring). Children are deterministic.
    """
    root = _as_tokens(root_tokens)
    B = root.numel()
    _check_drafter(marginals, None, B)
    device = marginals.device
    root = root.to(device)
    caps = _caps(budget, B, device)
    D, V = marginals.shape[1], marginals.shape[2]
    L = min(D if max_depth is None else int(max_depth), D, MAX_DEPTH)
    c = min(int(caps.max()) if top_k is None else int(top_k), V)
    if c <= 0 or L <= 0:
        L = 0
        top_v = top_i = None
    else:
        top_v, top_i = marginals.topk(c, dim=-1)  # [B, D, c]

    def expand(fr: Frontier):
        d = fr.depth
        return top_v[fr.request, d], top_i[fr.request, d], fr.request * D + d

    tree, ex = _best_first(root, expand, caps, total_budget, L, None)
    return DraftTree(
        tree=tree,
        draft_probs=ex["q"],
        scores=ex["lr"].exp(),
        children=CHILDREN_DETERMINISTIC,
        child_dist_table=marginals.reshape(-1, V),
        child_dist_index=ex["row"],
        source_ids=ex["nid"],
    )


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
    root = _as_tokens(root_tokens)
    B = root.numel()
    device = root.device
    caps = _caps(budget, B, device)
    L = min(int(max_depth), MAX_DEPTH)
    tables: list[torch.Tensor] = []
    n_rows = [0]

    def expand(fr: Frontier):
        probs = _call_step(step_fn, fr)
        c = min(int(caps.max()) if top_k is None else int(top_k), probs.shape[1])
        v, t = probs.topk(c, dim=-1)
        rows = None
        if keep_dists:
            rows = n_rows[0] + torch.arange(fr.size, device=probs.device)
            tables.append(probs)
            n_rows[0] += fr.size
        return v, t, rows

    tree, ex = _best_first(root, expand, caps, total_budget, L, beam)
    return DraftTree(
        tree=tree,
        draft_probs=ex["q"],
        scores=ex["lr"].exp(),
        children=CHILDREN_DETERMINISTIC,
        child_dist_table=(torch.cat(tables, 0) if tables else None) if keep_dists else None,
        child_dist_index=ex["row"] if keep_dists else None,
        source_ids=ex["nid"],
    )
