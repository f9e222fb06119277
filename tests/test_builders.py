"""Offline draft-tree builders (vllm_bole.spec_decode.offline) and the runtime best-first builder:
invariants, determinism, optimality against brute force, and the runtime path against the old one."""
import itertools
import math

import pytest
import torch

from vllm_bole.spec_decode.offline import (
    CHILDREN_DETERMINISTIC,
    CHILDREN_WITH_REPLACEMENT,
    CHILDREN_WITHOUT_REPLACEMENT,
    DraftTree,
    Frontier,
    StaticTree,
    acceptance_stats,
    build_best_first,
    build_best_first_autoregressive,
    build_best_first_batch,
    build_sampled,
    build_static,
    expected_tokens,
    optimal_static_tree,
)
from vllm_bole.spec_decode.best_first import best_first_slots, best_first_tree
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.sampling import sample_rows_without_replacement
from vllm_bole.spec_decode.tree import TreeBatch, TreeError
from vllm_bole.testing.stats import chi2_pvalue


# ----------------------------------------------------------------------------------- helpers
def request_lists(dt: DraftTree, r: int):
    s, e = int(dt.tree.cu_nodes[r]), int(dt.tree.cu_nodes[r + 1])
    return (dt.tree.parent[s:e].tolist(), dt.tree.token_ids[s:e].tolist(), dt.scores[s:e].tolist(),
            dt.draft_probs[s:e].tolist(), dt.tree.depth[s:e].tolist())


def token_paths(parents, tokens):
    paths = []
    for i, p in enumerate(parents):
        paths.append(() if p < 0 else paths[p] + (tokens[i],))
    return paths


def check_invariants(dt: DraftTree, budget, max_depth: int, distinct_siblings: bool = True):
    tree = dt.tree
    # re-validating the flat arrays gives the same tree (topological order, one root, depth, path)
    again = TreeBatch.from_flat(tree.parent, tree.token_ids, tree.cu_nodes, max_depth=tree.max_depth)
    for f in ("token_ids", "parent", "depth", "cu_nodes", "path", "anc_mask"):
        assert torch.equal(getattr(again, f), getattr(tree, f)), f
    B = tree.num_requests
    budgets = torch.as_tensor(budget).expand(B)
    sizes = tree.nodes_per_request
    assert (sizes <= budgets + 1).all()
    assert int(tree.depth.max()) <= max_depth
    for r in range(B):
        par, tok, sc, q, dep = request_lists(dt, r)
        assert par[0] == -1 and abs(sc[0] - 1) < 1e-12
        for i in range(1, len(par)):
            assert 0 <= par[i] < i
            assert sc[i] == pytest.approx(sc[par[i]] * q[i], rel=1e-5, abs=1e-300)
            assert sc[i] <= sc[par[i]] + 1e-12
        if distinct_siblings:
            keys = [(par[i], tok[i]) for i in range(1, len(par))]
            assert len(keys) == len(set(keys)), "siblings repeat a token"


def brute_force_best(weight_fn, V: int, D: int, N: int) -> float:
    """Max over prefix-closed sets of <= N paths (length 1..D over V tokens) of sum weight."""
    cands = [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]
    w = {p: weight_fn(p) for p in cands}
    best = [0.0]

    def rec(i, chosen, count, total):
        if total > best[0]:
            best[0] = total
        if count == N:
            return
        for j in range(i, len(cands)):
            p = cands[j]
            if len(p) == 1 or p[:-1] in chosen:
                chosen.add(p)
                rec(j + 1, chosen, count + 1, total + w[p])
                chosen.remove(p)

    rec(0, set(), 0, 0.0)
    return best[0]


def brute_force_sizes(weight_fn, V, D, N):
    return [brute_force_best(weight_fn, V, D, n) for n in range(N + 1)]


def rho_from_marginals(m):  # m [D, V]
    def f(path):
        return math.prod(float(m[k, t]) for k, t in enumerate(path))
    return f


# ------------------------------------------------------------------------------ static shapes
def test_chain_and_kary_shapes():
    c = StaticTree.chain(4)
    assert c.parents == (-1, 0, 1, 2, 3) and c.ranks == (0,) * 5 and c.max_depth == 4
    k = StaticTree.full([2, 3])
    assert k.num_nodes == 1 + 2 + 6 and k.max_depth == 2 and k.contiguous_ranks
    assert k.parents[:3] == (-1, 0, 0) and k.ranks[3:6] == (0, 1, 2)
    assert StaticTree.chain(0).num_nodes == 1
    with pytest.raises(TreeError):
        StaticTree((-1, 0, 0), (0, 1, 1))  # repeated sibling rank
    with pytest.raises(TreeError):
        StaticTree((-1, 2, 0), (0, 0, 0))  # not topological


def brute_force_static(p: torch.Tensor, N: int, D: int, K: int) -> float:
    """Best expected_tokens over prefix-closed, rank-contiguous rank trees (<= N draft nodes)."""
    cands = [s for d in range(1, D + 1) for s in itertools.product(range(K), repeat=d)]
    best = [1.0]

    def weight(s):
        return math.prod(float(p[k, r]) for k, r in enumerate(s))

    def rec(i, chosen, count, total):
        best[0] = max(best[0], total)
        if count == N:
            return
        for j in range(i, len(cands)):
            s = cands[j]
            if (len(s) == 1 or s[:-1] in chosen) and (s[-1] == 0 or s[:-1] + (s[-1] - 1,) in chosen):
                chosen.add(s)
                rec(j + 1, chosen, count + 1, total + weight(s))
                chosen.remove(s)

    rec(0, set(), 0, 1.0)
    return best[0]


@pytest.mark.parametrize("seed", range(6))
def test_optimal_static_tree_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    D, K = 3, 3
    if seed % 2 == 0:  # per rank, decreasing
        p1 = torch.sort(torch.rand(K, generator=g), descending=True).values
        p1 = p1 / p1.sum() * 0.9
        stats, p = p1, p1[None].expand(D, K)
    else:  # per (depth, rank), arbitrary order, rows sum < 1
        p = torch.rand(D, K, generator=g)
        p = p / p.sum(1, keepdim=True) * torch.rand(D, 1, generator=g)
        stats = p
    for N in range(0, 6):
        st = optimal_static_tree(stats, N, max_depth=D)
        assert st.budget <= N and st.max_depth <= D and st.contiguous_ranks
        brute = brute_force_static(p, N, D, K)
        assert st.expected == pytest.approx(brute, abs=1e-12)
        assert expected_tokens(st, stats) == pytest.approx(brute, abs=1e-12)


def test_optimal_static_tree_limits():
    st = optimal_static_tree([0.8], 6, max_depth=4)  # one rank: a chain capped by depth
    assert st.parents == (-1, 0, 1, 2, 3)
    assert st.expected == pytest.approx(sum(0.8**k for k in range(5)))
    st = optimal_static_tree([0.5, 0.3, 0.1], 40, max_depth=5)
    assert st.budget <= 40 and st.max_depth <= 5
    bigger = optimal_static_tree([0.5, 0.3, 0.1], 60, max_depth=5)
    assert bigger.expected >= st.expected
    # a sanity comparison: the optimum beats chain and 2-ary of the same budget
    assert st.expected >= expected_tokens(StaticTree.full([2, 2, 2, 2]), [0.5, 0.3, 0.1]) - 1e-12
    assert optimal_static_tree([0.5], 0).num_nodes == 1


def test_acceptance_stats():
    depths = torch.tensor([1, 1, 1, 1, 2, 2, 3])
    ranks = torch.tensor([0, 0, 1, -1, 0, 5, 2])
    p = acceptance_stats(depths, ranks, num_ranks=3, max_depth=3)
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64))


# ------------------------------------------------------------------------ static instantiation
def test_build_static_one_pass_topk_and_tiling():
    g = torch.Generator().manual_seed(0)
    B, D, V = 5, 3, 9
    m = torch.rand(B, D, V, generator=g).softmax(-1)
    roots = torch.arange(B)
    tmpl = StaticTree.full([3, 2, 1])
    dt = build_static(tmpl, roots, marginals=m)
    assert dt.children == CHILDREN_DETERMINISTIC
    check_invariants(dt, tmpl.budget, 3)
    top = m.topk(3, dim=-1).indices
    deps = torch.tensor(tmpl.depths)
    rks = torch.tensor(tmpl.ranks)
    tok = dt.tree.token_ids.view(B, -1)
    for b in range(B):
        assert tok[b, 0] == b
        for i in range(1, tmpl.num_nodes):
            assert tok[b, i] == top[b, deps[i] - 1, rks[i]]
    # draft probabilities / child distributions point at the right marginal rows
    dists = dt.child_dists()
    nodes_dep = dt.tree.depth.long()
    req = dt.tree.request_index
    has = nodes_dep < D
    assert torch.equal(dists[has], m[req[has], nodes_dep[has]])
    # the tiled fast path equals a validated build
    ref = TreeBatch.from_parents([list(tmpl.parents)] * B, tok.tolist())
    for f in ("token_ids", "parent", "depth", "cu_nodes", "path", "anc_mask"):
        assert torch.equal(getattr(ref, f), getattr(dt.tree, f)), f
    # chain = top-1 at every depth
    ch = build_static(StaticTree.chain(3), roots, marginals=m)
    assert torch.equal(ch.tree.token_ids.view(B, -1)[:, 1:], m.argmax(-1))


class PathDrafter:
    """A deterministic autoregressive drafter: q(. | path) from a hashed table, recording calls."""

    def __init__(self, V, seed=0, sharp=3.0, P=4099):
        g = torch.Generator().manual_seed(seed)
        self.table = (torch.randn(P, V, generator=g) * sharp).softmax(-1)
        self.P = P
        self.calls = []

    def key(self, path_tokens):
        h = torch.zeros(path_tokens.shape[0], dtype=torch.long)
        for k in range(path_tokens.shape[1]):
            h = (h * 1000003 + path_tokens[:, k] + 1) % 2147483647
        return h % self.P

    def probs_of(self, path):
        return self.table[self.key(torch.tensor([list(path)]))[0]]

    def __call__(self, fr: Frontier):
        assert fr.path_tokens.shape == (fr.size, fr.depth + 1)
        assert torch.equal(fr.path_tokens[:, -1], fr.token)
        self.calls.append(fr)
        return self.table[self.key(fr.path_tokens)]


def test_build_static_autoregressive():
    V = 7
    drafter = PathDrafter(V, seed=1)
    roots = torch.tensor([3, 5])
    tmpl = StaticTree.full([2, 2, 1])
    dt = build_static(tmpl, roots, step_fn=drafter)
    check_invariants(dt, tmpl.budget, 3)
    assert [fr.depth for fr in drafter.calls] == [0, 1, 2]  # one call per level
    for r in range(2):
        par, tok, sc, q, dep = request_lists(dt, r)
        paths = token_paths(par, tok)
        for i in range(1, len(par)):
            dist = drafter.probs_of((tok[0],) + paths[par[i]])
            assert tok[i] == int(dist.topk(2).indices[tmpl.ranks[i]])
            assert q[i] == pytest.approx(float(dist[tok[i]]))
    # the recorded child distributions are the drafter's outputs at each expanded node
    dists = dt.child_dists()
    for i in range(dt.tree.num_nodes):
        if int(dt.child_dist_index[i]) >= 0:
            r = int(dt.tree.request_index[i])
            par, tok, *_ = request_lists(dt, r)
            local = i - int(dt.tree.cu_nodes[r])
            path = (tok[0],) + token_paths(par, tok)[local]
            assert torch.allclose(dists[i], drafter.probs_of(path))


# --------------------------------------------------------------------------------- best-first
@pytest.mark.parametrize("V,D,N", [(3, 3, 1), (3, 3, 4), (3, 3, 6), (4, 3, 5), (2, 4, 6)])
def test_best_first_is_optimal_vs_brute_force(V, D, N):
    g = torch.Generator().manual_seed(V * 100 + D * 10 + N)
    B = 4
    m = (torch.randn(B, D, V, generator=g) * 1.5).softmax(-1)
    dt = build_best_first(torch.zeros(B, dtype=torch.long), m, N)
    check_invariants(dt, N, D)
    got = dt.expected_accepted()
    for b in range(B):
        best = brute_force_best(rho_from_marginals(m[b]), V, D, N)
        assert float(got[b]) == pytest.approx(best, rel=1e-9), (b, float(got[b]), best)
        par, tok, sc, q, dep = request_lists(dt, b)
        for i in range(1, len(par)):  # draft probabilities come from marginal depth-1
            assert q[i] == pytest.approx(float(m[b, dep[i] - 1, tok[i]]))


def test_best_first_limits_and_ties():
    B, D, V = 3, 5, 4
    # ties everywhere (uniform marginals) and a degenerate drafter (probability-1 tokens)
    m = torch.full((B, D, V), 1.0 / V)
    m[1] = 0
    m[1, :, 2] = 1.0
    budget = torch.tensor([7, 4, 0])
    dt = build_best_first(torch.tensor([1, 2, 3]), m, budget, max_depth=4)
    check_invariants(dt, budget, 4)
    assert dt.tree.nodes_per_request.tolist() == [8, 5, 1]
    par, tok, *_ = request_lists(dt, 1)
    assert par == [-1, 0, 1, 2, 3] and tok[1:] == [2, 2, 2, 2]  # a chain of the certain token
    # deterministic: same input, same tree
    dt2 = build_best_first(torch.tensor([1, 2, 3]), m, budget, max_depth=4)
    assert torch.equal(dt.tree.token_ids, dt2.tree.token_ids) and torch.equal(dt.tree.parent, dt2.tree.parent)
    # top_k limits the children per node
    g = torch.Generator().manual_seed(3)
    m = torch.rand(2, 4, 10, generator=g).softmax(-1)
    dt = build_best_first(torch.tensor([0, 0]), m, 20, top_k=2)
    counts = torch.bincount(dt.tree.parent_flat[dt.tree.parent_flat >= 0])
    assert int(counts.max()) <= 2


def test_best_first_autoregressive_is_optimal_vs_brute_force():
    V, D = 3, 3
    for seed, N in [(0, 3), (1, 5), (2, 6)]:
        drafter = PathDrafter(V, seed=seed, sharp=1.5)
        roots = torch.tensor([0, 1, 2])
        dt = build_best_first_autoregressive(roots, drafter, N, max_depth=D)
        check_invariants(dt, N, D)
        assert [fr.depth for fr in drafter.calls] == list(range(len(drafter.calls)))  # level by level
        got = dt.expected_accepted()
        for b in range(3):
            def w(path, b=b):
                full = (int(roots[b]),) + path
                return math.prod(float(drafter.probs_of(full[: k + 1])[full[k + 1]]) for k in range(len(path)))
            best = brute_force_best(w, V, D, N)
            assert float(got[b]) == pytest.approx(best, rel=1e-6)


def test_best_first_autoregressive_beam_and_ids():
    V = 12
    drafter = PathDrafter(V, seed=5)
    roots = torch.tensor([4, 7, 9, 1])
    budget = torch.tensor([10, 3, 16, 0])
    dt = build_best_first_autoregressive(roots, drafter, budget, max_depth=6, top_k=3, beam=2)
    check_invariants(dt, budget, 6)
    for fr in drafter.calls:  # at most `beam` expanded nodes per request per level
        assert int(torch.bincount(fr.request).max()) <= 2
        assert (fr.request != 3).all()  # budget 0: never expanded
    # every node's source id was handed to the drafter as the child of its parent's id
    seen = {}
    for fr in drafter.calls:
        for r, n, p in zip(fr.request.tolist(), fr.node_id.tolist(), fr.parent_id.tolist()):
            seen[(r, n)] = p
    for r in range(4):
        s, e = int(dt.tree.cu_nodes[r]), int(dt.tree.cu_nodes[r + 1])
        ids = dt.source_ids[s:e].tolist()
        par = dt.tree.parent[s:e].tolist()
        for i in range(1, e - s):
            if (r, ids[i]) in seen:
                assert seen[(r, ids[i])] == ids[par[i]]


def test_batch_wide_best_first_matches_brute_force():
    V, D = 3, 3
    g = torch.Generator().manual_seed(11)
    B = 3
    m = (torch.randn(B, D, V, generator=g) * 2).softmax(-1)
    caps = torch.tensor([4, 2, 5])
    per = [brute_force_sizes(rho_from_marginals(m[b]), V, D, int(caps[b])) for b in range(B)]
    for total in [0, 1, 3, 6, 11, 20]:
        dt = build_best_first_batch(torch.zeros(B, dtype=torch.long), m, total, max_per_request=caps)
        check_invariants(dt, caps, D)
        assert int(dt.tree.nodes_per_request.sum()) - B <= total
        best = max(
            per[0][a] + per[1][b] + per[2][c]
            for a in range(5) for b in range(3) for c in range(6) if a + b + c <= total
        )
        assert float(dt.expected_accepted().sum()) == pytest.approx(best, rel=1e-9), total


def test_batch_wide_autoregressive_respects_total():
    drafter = PathDrafter(8, seed=2)
    dt = build_best_first_autoregressive(torch.arange(5), drafter, 10, max_depth=4, total_budget=17)
    check_invariants(dt, 10, 4)
    assert int(dt.tree.nodes_per_request.sum()) - 5 == 17


# ----------------------------------------------------------------------------- sampled trees
def test_sampled_children_invariants_and_determinism():
    g = torch.Generator().manual_seed(0)
    B, D, V = 64, 3, 6
    m = (torch.randn(B, D, V, generator=g) * 2).softmax(-1)
    tmpl = StaticTree.full([3, 2, 1])
    for repl in (True, False):
        a = build_sampled(tmpl, torch.zeros(B, dtype=torch.long), marginals=m, replacement=repl,
                          generator=torch.Generator().manual_seed(7))
        b = build_sampled(tmpl, torch.zeros(B, dtype=torch.long), marginals=m, replacement=repl,
                          generator=torch.Generator().manual_seed(7))
        c = build_sampled(tmpl, torch.zeros(B, dtype=torch.long), marginals=m, replacement=repl,
                          generator=torch.Generator().manual_seed(8))
        assert a.children == (CHILDREN_WITH_REPLACEMENT if repl else CHILDREN_WITHOUT_REPLACEMENT)
        assert torch.equal(a.tree.token_ids, b.tree.token_ids)
        assert not torch.equal(a.tree.token_ids, c.tree.token_ids)
        check_invariants(a, tmpl.budget, 3, distinct_siblings=not repl)
        assert (a.draft_probs > 0).all()
    # support smaller than the number of children: without replacement drops the missing ones
    m2 = torch.zeros(4, 2, V)
    m2[..., :2] = 0.5
    dt = build_sampled(StaticTree.full([3, 3]), torch.zeros(4, dtype=torch.long), marginals=m2, replacement=False,
                       generator=torch.Generator().manual_seed(0))
    check_invariants(dt, 12, 2)
    assert dt.tree.nodes_per_request.tolist() == [7, 7, 7, 7]  # 2 + 2 * 2 draft nodes
    for r in range(4):
        par, tok, *_ = request_lists(dt, r)
        assert sorted(tok[1:3]) == [0, 1]


def test_sampled_autoregressive_records_distributions():
    drafter = PathDrafter(6, seed=4)
    dt = build_sampled(StaticTree.full([2, 2]), torch.tensor([0, 3, 5]), step_fn=drafter, replacement=False,
                       generator=torch.Generator().manual_seed(1))
    check_invariants(dt, 6, 2)
    dists = dt.child_dists()
    for i in range(dt.tree.num_nodes):
        r = int(dt.tree.request_index[i])
        par, tok, *_ = request_lists(dt, r)
        local = i - int(dt.tree.cu_nodes[r])
        if dt.tree.depth[i] < 2:
            path = (tok[0],) + token_paths(par, tok)[local]
            assert torch.allclose(dists[i], drafter.probs_of(path))


def test_without_replacement_sampler_distribution():
    """First two draws without replacement: P(x1, x2) = q(x1) q(x2) / (1 - q(x1))."""
    q = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.07, 0.03]])
    n = 100_000
    u = torch.rand(1, n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, ok = sample_rows_without_replacement(q, u)
    assert ok.all()
    tok = tok[0]
    assert (tok[:, 0] != tok[:, 1]).all() and (tok[:, 1] != tok[:, 2]).all() and (tok[:, 0] != tok[:, 2]).all()
    V = 6
    expect = q[0][:, None] * q[0][None, :] / (1 - q[0][:, None])
    expect.fill_diagonal_(0)
    counts = torch.bincount(tok[:, 0] * V + tok[:, 1], minlength=V * V)
    assert chi2_pvalue(counts, expect) > 1e-4
    # a sampler that forgets to remove the first draw is caught
    bad = torch.bincount(tok[:, 0] * V + torch.multinomial(q[0], n, replacement=True,
                                                          generator=torch.Generator().manual_seed(1)),
                         minlength=V * V)
    assert chi2_pvalue(bad, expect) < 1e-6


def test_drafter_argument_errors():
    with pytest.raises(ValueError):
        build_static(StaticTree.chain(2), torch.tensor([0]))
    with pytest.raises(ValueError):
        build_static(StaticTree.chain(4), torch.tensor([0]), marginals=torch.rand(1, 2, 5))
    with pytest.raises(ValueError):
        build_best_first(torch.tensor([0, 1]), torch.rand(2, 2, 5), 300)


# ------------------------------------------------------------------- runtime best-first builder
def random_candidates(g: torch.Generator, B: int, D: int, K: int, V: int) -> Candidates:
    """Distinct tokens per depth, distinct probabilities sorted best first, ragged padding: some
    depths cut short, some requests without any candidate."""
    tok = torch.stack([torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(D)]) for _ in range(B)])
    prob = torch.rand(B, D, K, generator=g).sort(-1, descending=True).values * 0.9 + 1e-3
    cut = torch.randint(0, K + 1, (B, D), generator=g)
    cut[torch.rand(B, generator=g) < 0.2] = 0
    pad = torch.arange(K)[None, None, :] >= cut[..., None]
    return Candidates(tok.masked_fill(pad, -1), prob.masked_fill(pad, 0.0)).validate()


def old_draft_trees(roots, cands: Candidates, budget, max_depth, top_k):
    """The runner's previous path, kept as the reference: per-request candidate lists (cut at the
    first depth without a candidate) -> one compact vocabulary -> dense marginals [live, D, U] ->
    dense best-first -> per-request (parents, tokens) of the draft nodes."""
    B = len(roots)
    budgets = [int(budget)] * B if isinstance(budget, int) else [int(b) for b in budget]
    lists = []
    for b in range(B):
        toks, probs = [], []
        for d in range(cands.depth):
            keep = cands.tokens[b, d] >= 0
            if not bool(keep.any()):
                break
            toks.append(cands.tokens[b, d][keep])
            probs.append(cands.probs[b, d][keep])
        lists.append((toks, probs))
    out = [([], []) for _ in range(B)]
    live = [r for r in range(B) if lists[r][0] and budgets[r] > 0]
    if not live:
        return out
    D = min(max_depth, max(len(lists[r][0]) for r in live))
    vocab = torch.unique(torch.cat([t for r in live for t in lists[r][0][:D]]))
    U = vocab.numel()
    marg = torch.zeros(len(live), D, U)
    for i, r in enumerate(live):
        for d, (t, p) in enumerate(zip(lists[r][0][:D], lists[r][1][:D])):
            marg[i, d, torch.searchsorted(vocab, t)] = p
    dt = build_best_first(torch.zeros(len(live), dtype=torch.long), marg, torch.tensor([budgets[r] for r in live]),
                          max_depth=D, top_k=top_k)
    cu, par = dt.tree.cu_nodes.tolist(), dt.tree.parent.tolist()
    tok = vocab[dt.tree.token_ids.clamp(max=U - 1)].tolist()
    for i, r in enumerate(live):
        out[r] = (par[cu[i] + 1: cu[i + 1]], tok[cu[i] + 1: cu[i + 1]])
    return out


@pytest.mark.parametrize("seed", range(8))
def test_runtime_best_first_equals_the_old_dense_path(seed):
    g = torch.Generator().manual_seed(400 + seed)
    B, D, K, V = 7, int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)), 40
    cands = random_candidates(g, B, D, K, V)
    roots = torch.randint(0, V, (B,), generator=g)
    budget = torch.randint(0, 20, (B,), generator=g).tolist() if seed % 2 else 12
    max_depth = int(torch.randint(1, D + 2, (1,), generator=g))
    top_k = [None, 1, 3][seed % 3]
    tree = best_first_tree(roots, cands, budget, max_depth=max_depth, top_k=top_k)
    want = old_draft_trees(roots.tolist(), cands, budget, max_depth, top_k)
    assert tree.num_requests == B and tree.token_ids[tree.cu_nodes[:-1].long()].tolist() == roots.tolist()
    for b in range(B):
        par, tok = tree.request(b)
        assert (par[1:], tok[1:]) == want[b], b
    assert tree.draft_token_ids() == [w[1] for w in want]
    # the tree's path and ancestor mask are the validated ones
    again = TreeBatch.from_flat(tree.parent, tree.token_ids, tree.cu_nodes)
    for f in ("path", "anc_mask", "depth"):
        assert torch.equal(getattr(again, f), getattr(tree, f))


def test_runtime_best_first_optimal_ordered_and_batch_wide():
    g = torch.Generator().manual_seed(5)
    B, D, K, V = 4, 3, 3, 3
    cands = random_candidates(g, B, D, K, V)
    dense = cands.to_dense(V)
    tree = best_first_tree(torch.zeros(B, dtype=torch.long), cands, 5)
    ref = build_best_first(torch.zeros(B, dtype=torch.long), dense, 5)
    assert torch.equal(tree.parent, ref.tree.parent) and torch.equal(tree.token_ids, ref.tree.token_ids)
    for b in range(B):  # optimal: sum rho of the tree = brute force
        best = brute_force_best(rho_from_marginals(dense[b]), V, D, 5)
        assert float(ref.expected_accepted()[b]) == pytest.approx(best, rel=1e-9)
    # candidates in any order within a depth give the same tree (the builder sorts them)
    perm = torch.argsort(torch.rand(B, D, K, generator=g), -1)
    shuffled = Candidates(cands.tokens.gather(-1, perm), cands.probs.gather(-1, perm))
    same = best_first_tree(torch.zeros(B, dtype=torch.long), shuffled, 5)
    assert torch.equal(same.parent, tree.parent) and torch.equal(same.token_ids, tree.token_ids)
    # batch-wide budget = the dense batch-wide builder
    wide = best_first_tree(torch.zeros(B, dtype=torch.long), cands, 5, total_budget=7)
    ref = build_best_first_batch(torch.zeros(B, dtype=torch.long), dense, 7, max_per_request=5)
    assert torch.equal(wide.parent, ref.tree.parent) and torch.equal(wide.cu_nodes, ref.tree.cu_nodes)
    assert int(wide.nodes_per_request.sum()) - B <= 7
    # no candidates / no budget / no depth: root-only trees
    for t in (best_first_tree([1, 2], Candidates.empty(2, 3, 2), 4), best_first_tree([1, 2], cands.__class__(
            cands.tokens[:2], cands.probs[:2]), 0), best_first_tree([1, 2], Candidates.empty(2, 0, 2), 4)):
        assert t.nodes_per_request.tolist() == [1, 1] and t.token_ids.tolist() == [1, 2]
    with pytest.raises(ValueError):
        best_first_tree([1], cands, 4)  # one root for four requests


def test_slots_tree_equals_the_validated_build():
    """``Slots.tree()`` builds the TreeBatch directly from the search state: equal, field by field,
    to building it from the kept parents and tokens with every check (ragged budgets, empty trees, a tree of 251
    nodes: eight ancestor words)."""
    g = torch.Generator().manual_seed(21)
    B, D, K = 6, 9, 4
    probs = (torch.randn(B, D, K, generator=g) * 1.5).softmax(-1).sort(-1, descending=True).values
    tokens = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(B * D)]).view(B, D, K)
    s = best_first_slots(torch.arange(B), Candidates(tokens, probs), torch.tensor([0, 3, 40, 7, 12, 250]))
    assert int(s.valid.sum(1).max()) == 251
    got = s.tree()
    counts = s.valid.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.long)
    cu[1:] = counts.cumsum(0)
    want = TreeBatch.from_flat(s.flat("parent"), s.flat("token"), cu)
    for name in ("token_ids", "parent", "depth", "cu_nodes", "path", "anc_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.max_nodes == want.max_nodes and torch.equal(got.draft_prob, s.flat("qprob"))


def tie_candidates(g: torch.Generator, it: int) -> Candidates:
    """Random per-depth candidates of case ``it``: softmax, uniform (ties everywhere), quarters (ties and
    zero probabilities), heavy-tailed; 1-5 requests, depth 1-8, 1-6 candidates."""
    B, D, K = (int(torch.randint(1, n, (1,), generator=g)) for n in (6, 9, 7))
    probs = [torch.rand(B, D, K, generator=g).softmax(-1), torch.full((B, D, K), 1.0 / K),
             torch.randint(0, 4, (B, D, K), generator=g).float() / 4, torch.rand(B, D, K, generator=g) ** 4][it % 4]
    probs = probs.sort(-1, descending=True).values
    tokens = torch.where(probs > 0, torch.randint(0, 100, (B, D, K), generator=g), -1)
    return Candidates(tokens, torch.where(tokens >= 0, probs, 0.0))


@pytest.mark.parametrize("seed", range(6))
def test_runtime_best_first_heap_equals_level_wise(seed, monkeypatch):
    """The priority-queue search (small batches) and the level-wise one give the same search state on
    every valid slot: ties everywhere, zero probabilities, ragged and zero budgets, top_k, max_depth,
    calibration factors and a batch-wide budget."""
    import vllm_bole.spec_decode.best_first as bf

    g = torch.Generator().manual_seed(700 + seed)
    for it in range(60):
        cands = tie_candidates(g, it)
        B, D, K = cands.tokens.shape
        budget = torch.randint(0, 25, (B,), generator=g) if it % 3 else int(torch.randint(0, 30, (1,), generator=g))
        opts = dict(max_depth=int(torch.randint(1, D + 2, (1,), generator=g)), top_k=[None, 1, 2, 5][it % 4])
        if it % 5 == 0:
            opts["total_budget"] = int(torch.randint(0, 30, (1,), generator=g))
        if it % 2:
            opts["calibration"] = torch.rand(65, 3, generator=g) * 2
        roots = torch.randint(0, 100, (B,), generator=g)
        got = {}
        for name, slots in (("heap", 10**9), ("levels", 0)):
            monkeypatch.setattr(bf, "HEAP_SLOTS", slots)
            got[name] = best_first_slots(roots, cands, budget, **opts)
        a, b = got["heap"], got["levels"]
        assert torch.equal(a.valid, b.valid), (seed, it)
        for f in ("token", "parent", "depth", "logrho", "qprob", "kind", "row"):
            assert torch.equal(getattr(a, f)[a.valid], getattr(b, f)[b.valid]), (seed, it, f)


@pytest.mark.parametrize("seed", range(4))
def test_level_search_equals_the_host_search(seed):
    """``level_search`` (torch, fixed shapes, graph-safe: the paged draft runs it inside its step) gives
    ``best_first_slots``' search state on every kept slot: ties, zero probabilities, ragged and zero
    budgets, calibration factors (ones: none), more slots than the largest budget needs."""
    from vllm_bole.spec_decode.best_first import level_search

    g = torch.Generator().manual_seed(900 + seed)
    for it in range(50):
        cands = tie_candidates(g, it)
        B = cands.num_requests
        caps = torch.randint(0, 25, (B,), generator=g)
        cal = torch.rand(65, 3, generator=g) * 2 if it % 2 else None
        roots = torch.randint(0, 100, (B,), generator=g)
        want = best_first_slots(roots, cands, caps, calibration=cal)
        got = level_search(roots, cands.probs, cands.tokens, caps, int(caps.max()) + 1 + it % 3,
                           cal if cal is not None else torch.ones(65, 3))
        S = want.valid.shape[1]
        assert torch.equal(got.valid[:, :S], want.valid) and not got.valid[:, S:].any(), (seed, it)
        for f in ("token", "parent", "depth", "logrho", "qprob", "kind"):
            assert torch.equal(getattr(got, f)[:, :S][want.valid], getattr(want, f)[want.valid]), (seed, it, f)


def test_level_search_builds_no_tensor_from_host_data():
    """The paged draft runs ``level_search_packed`` inside a CUDA graph capture, which refuses host-to-device
    copies: the search must not build a tensor from Python data (``torch.tensor([...], device=...)``,
    dispatched as ``lift_fresh``; the CPU tests cannot see the capture itself). 0ea3e7c built two."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_bole.spec_decode.best_first import level_search_packed, root_only_packed

    class Seen(TorchDispatchMode):
        ops: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.__name__)
            return func(*args, **(kwargs or {}))

    cands = tie_candidates(torch.Generator().manual_seed(5), 0)
    B = cands.num_requests
    roots, caps, cal = torch.arange(B), torch.full((B,), 6), torch.ones(65, 3)
    with Seen() as seen:
        level_search_packed(roots, cands.probs, cands.tokens, caps, 8, cal)
        root_only_packed(roots, 8)
    assert seen.ops and not {op for op in seen.ops if op.startswith("lift_fresh")}, seen.ops


def test_level_search_kernel_equals_twin_over_the_envelope():
    """The search in one Triton launch per step (interpreter) against its torch twin, bit for bit, over
    ``search_cases``: slots 1..256 (tile edges), depth levels to 64, 1-8 candidates, ties and zero
    probabilities, calibration zeros, ragged, zero and full budgets."""
    from vllm_bole.spec_decode.best_first import level_search_packed
    from vllm_bole.testing.oracles import search_cases

    for case in search_cases(torch.Generator().manual_seed(31)):
        want = level_search_packed(*case, kernels="torch")
        got = level_search_packed(*case, kernels="triton")
        assert torch.equal(got, want), [tuple(x.shape) for x in case[1:3]]
    assert int(got[-1, :, 3].max()) == 64  # the last case's main path
