"""Pure logic of the acceptance benchmark (no model, no data): greedy acceptance of a tree against a
known continuation (vs brute force and vs greedy verification), the decoding walk, k-ary templates,
calibration observations, candidate compaction, the n-gram drafter (vs a direct
implementation of its definition, batched vs one by one) and the corpus simulation."""
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from acceptance_sim import (  # noqa: E402
    accepted_lengths,
    compact_candidates,
    conditioned_observations,
    rank_of,
    walk,
)
from vllm_bole.spec_decode.candidates import Candidates  # noqa: E402
from vllm_bole.spec_decode.ngram import NgramDrafter, suffix_match_lengths  # noqa: E402
from vllm_bole.spec_decode.offline import StaticTree, acceptance_stats, build_best_first, build_static  # noqa: E402
from vllm_bole.spec_decode.tree import TreeBatch  # noqa: E402
from vllm_bole.spec_decode.verification import verify_greedy  # noqa: E402


# ------------------------------------------------------------------------------ acceptance
def random_trees(rng: random.Random, B: int, V: int, max_nodes: int):
    parents, tokens = [], []
    for _ in range(B):
        n = rng.randint(1, max_nodes)
        parents.append([-1] + [rng.randrange(i) for i in range(1, n)])
        tokens.append([rng.randrange(V) for _ in range(n)])
    return parents, tokens


def brute_force_accept(parents, tokens, ref, blocked=()):
    """Deepest node whose path spells ref[0..d-1], by explicit path walking."""
    best = 0
    for i in range(1, len(parents)):
        path, j = [], i
        while j > 0:
            path.append(j)
            j = parents[j]
        path.reverse()
        if len(path) <= len(ref) and all(tokens[k] == ref[d] and ref[d] >= 0 and k not in blocked
                                          for d, k in enumerate(path)):
            best = max(best, len(path))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_accepted_lengths_matches_brute_force(seed):
    rng = random.Random(seed)
    V, B = 3, 40
    parents, tokens = random_trees(rng, B, V, 14)
    tree = TreeBatch.from_parents(parents, tokens)
    H = 6
    ref = torch.tensor([[rng.randrange(V) for _ in range(H)] for _ in range(B)])
    for b in range(B):  # unknown tails (reference ends)
        cut = rng.randint(0, H)
        ref[b, cut:] = -1
    node_tokens = tree.token_ids.clone()
    blocked = set()
    for i in range(tree.num_nodes):  # a few never-matching nodes
        if rng.random() < 0.1:
            node_tokens[i] = -1
            blocked.add(i)
    acc, node = accepted_lengths(tree, node_tokens, ref)
    for b in range(B):
        s = int(tree.cu_nodes[b])
        blk = {i - s for i in blocked if s <= i < int(tree.cu_nodes[b + 1])}
        assert int(acc[b]) == brute_force_accept(parents[b], tokens[b], ref[b].tolist(), blk)
        assert int(tree.depth[node[b]]) == int(acc[b])
        assert int(tree.request_index[node[b]]) == b


@pytest.mark.parametrize("seed", range(4))
def test_accepted_lengths_equals_greedy_verification(seed):
    """Target logits whose argmax at depth d is ref[d]: verify_greedy accepts the same path."""
    rng = random.Random(100 + seed)
    V, B, H = 4, 30, 12
    parents, tokens = random_trees(rng, B, V, 16)
    tree = TreeBatch.from_parents(parents, tokens)
    ref = torch.tensor([[rng.randrange(V) for _ in range(H)] for _ in range(B)])
    req, depth = tree.request_index, tree.depth.long()
    logits = torch.randn(tree.num_nodes, V)
    logits[torch.arange(tree.num_nodes), ref[req, depth]] = 10.0  # argmax after the node = ref at depth + 1
    res = verify_greedy(tree, logits)
    acc, node = accepted_lengths(tree, tree.token_ids, ref)
    assert torch.equal(res.num_accepted, acc)
    assert torch.equal(res.last_node, node)


def test_accepted_lengths_repeated_sibling_tokens_take_the_first():
    tree = TreeBatch.from_parents([[-1, 0, 0, 1, 2]], [[9, 5, 5, 7, 7]])
    acc, node = accepted_lengths(tree, tree.token_ids, torch.tensor([[5, 7, 1]]))
    assert int(acc[0]) == 2 and int(node[0]) == 3


# ------------------------------------------------------------------------------------ walk
def test_walk_matches_sequential_loop():
    rng = random.Random(7)
    lengths = [rng.randint(0, 40) for _ in range(25)]
    table = {(p, t): rng.randint(0, 5) for p in range(25) for t in range(1, 41)}
    calls = []

    def accept_fn(p, t):
        calls.append(p.numel())
        return torch.tensor([table[(int(a), int(b))] for a, b in zip(p, t)])

    steps, acc = walk(lengths, accept_fn)
    for p, L in enumerate(lengths):
        t, s, a = 1, 0, 0
        while t < L:
            x = table[(p, t)]
            s, a, t = s + 1, a + x, t + x + 1
        assert (int(steps[p]), int(acc[p])) == (s, a)
    assert max(calls) <= 25  # batched across prompts


def test_walk_full_acceptance_and_empty():
    steps, acc = walk([10, 1, 0], lambda p, t: torch.full_like(p, 100))
    assert steps.tolist() == [1, 0, 0] and acc.tolist() == [100, 0, 0]
    with pytest.raises(ValueError):
        walk([5], lambda p, t: torch.tensor([-1]))


# ----------------------------------------------------------------------- templates, stats
@pytest.mark.parametrize("k,n", [(1, 5), (2, 4), (2, 14), (3, 7), (4, 64)])
def test_kary_template(k, n):
    t = StaticTree.kary(k, n)
    assert t.budget == n and t.contiguous_ranks
    kids = {}
    for i in range(1, t.num_nodes):
        kids.setdefault(t.parents[i], []).append(i)
    # complete: every node but the last parent has exactly k children; BFS order
    full = sorted(kids)[:-1]
    assert all(len(kids[p]) == k for p in full)
    assert list(t.depths) == sorted(t.depths)
    if k == 1:
        assert t.parents == StaticTree.chain(n).parents


def test_conditioned_observations_and_stats():
    ranks = torch.tensor([[0, 1, 0], [2, 0, 0], [-1, 0, 0], [0, 0, -2], [5, 0, 0]])
    d, r = conditioned_observations(ranks, num_ranks=3)
    got = sorted(zip(d.tolist(), r.tolist()))
    # depth 1 always; depth 2 only if depth-1 rank in [0, 3); depth 3 if both; -2 cuts the sample
    want = sorted([(1, 0), (2, 1), (3, 0), (1, 2), (2, 0), (3, 0), (1, -1), (1, 0), (2, 0), (1, 5)])
    assert got == want
    p = acceptance_stats(d, r, 3, 3)
    assert p[0].tolist() == pytest.approx([2 / 5, 0.0, 1 / 5])
    assert p[1].tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_rank_of():
    c = torch.tensor([[4, 2, 9, -1], [1, -1, -1, -1]])
    assert rank_of(c, torch.tensor([9, 7])).tolist() == [2, -1]
    assert rank_of(c, torch.tensor([-1, 1])).tolist() == [-1, 0]


def test_compact_candidates_round_trip_and_builders():
    tok = torch.tensor([[[40, 7, -1], [7, -1, -1]], [[1000, -1, -1], [-1, -1, -1]]])
    prob = torch.tensor([[[0.5, 0.25, 0.0], [0.6, 0.0, 0.0]], [[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    marg, table = compact_candidates(tok, prob)
    assert table[0] == -1 and marg[..., 0].abs().sum() == 0
    dense = Candidates(tok, prob).to_dense(1001)
    for b in range(2):
        for d in range(2):
            for u in range(1, table.numel()):
                assert float(marg[b, d, u]) == pytest.approx(float(dense[b, d, int(table[u])]))
    roots = torch.tensor([3, 4])
    dt = build_best_first(roots, marg, 3, max_depth=2)
    real = table[dt.tree.token_ids.clamp(max=table.numel() - 1)]
    p0, _ = dt.tree.request(0)
    assert sorted(real[1: len(p0)].tolist()) == [7, 7, 40]  # 40 -> 7 and 7 -> 7
    # zero-probability fillers of a static template never match
    st = build_static(StaticTree.chain(2), roots, marginals=marg, keep_dists=False)
    nt = torch.where((st.tree.depth > 0) & (st.draft_probs > 0), table[st.tree.token_ids.clamp(max=table.numel() - 1)],
                     torch.full_like(st.tree.token_ids, -1))
    acc, _ = accepted_lengths(st.tree, nt, torch.tensor([[40, 7], [1000, 0]]))
    assert acc.tolist() == [2, 1]


# ----------------------------------------------------------------------------------- n-gram
def brute_suffix(c, j, max_n):
    n = 0
    while n < max_n and j - 1 - n >= 0 and c[j - 1 - n] == c[len(c) - 1 - n]:
        n += 1
    return n


def brute_proposal(c, depth, min_n, max_n, base, prior, top_k):
    T = len(c)
    groups = [dict() for _ in range(depth)]
    denom = [prior] * depth
    for j in range(1, T):
        ell = brute_suffix(c, j, max_n)
        if ell < min_n:
            continue
        w = base ** ell
        for k in range(1, depth + 1):
            if j + k - 1 < T:
                x = c[j + k - 1]
                wsum, rec = groups[k - 1].get(x, (0.0, -1))
                groups[k - 1][x] = (wsum + w, max(rec, j))
                denom[k - 1] += w
    out = []
    for k in range(depth):
        items = sorted(groups[k].items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:top_k]
        out.append([(x, ws / denom[k]) for x, (ws, _) in items])
    return out


@pytest.mark.parametrize("seed", range(8))
def test_suffix_match_lengths_brute_force(seed):
    rng = random.Random(seed)
    c = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
    got = suffix_match_lengths(torch.tensor(c), 5).tolist()
    assert got == [brute_suffix(c, j, 5) for j in range(len(c))]


@pytest.mark.parametrize("seed", range(10))
def test_ngram_proposal_matches_definition(seed):
    rng = random.Random(seed)
    V = rng.choice([2, 3, 5])
    c = [rng.randrange(V) for _ in range(rng.randint(2, 40))]
    min_n, max_n = rng.choice([(1, 3), (2, 4), (1, 1)])
    dr = NgramDrafter(min_n, max_n, top_k=3, base=2.0, prior=1.0)
    D = 5
    prop = dr.propose([c], [D]).validate()
    assert prop.tokens.shape == (1, D, 3)
    want = brute_proposal(c, D, min_n, max_n, 2.0, 1.0, 3)
    for k in range(D):
        toks = [t for t in prop.tokens[0, k].tolist() if t >= 0]
        assert toks == [x for x, _ in want[k]]
        assert prop.probs[0, k, : len(toks)].tolist() == pytest.approx([p for _, p in want[k]], rel=1e-5)
        assert float(prop.probs[0, k].sum()) < 1.0
        assert (prop.probs[0, k, len(toks):] == 0).all() and (prop.tokens[0, k, len(toks):] == -1).all()


@pytest.mark.parametrize("seed", range(6))
def test_ngram_batch_equals_one_by_one_and_definition(seed):
    """One vectorised pass over a batch (ragged histories, per-request depths, a window, empty and
    one-token histories) equals each request alone and the definition."""
    rng = random.Random(50 + seed)
    V = rng.choice([2, 3, 5])
    hists = [[rng.randrange(V) for _ in range(rng.randint(0, 45))] for _ in range(7)] + [[], [1]]
    depths = [rng.randint(0, 6) for _ in hists]
    dr = NgramDrafter(1, 3, top_k=3, base=2.0, prior=1.0, window=rng.choice([None, 20]))
    got = dr.propose(hists, depths).validate()
    assert got.tokens.shape == (len(hists), max(depths), 3)
    for b, (h, d) in enumerate(zip(hists, depths)):
        one = dr.propose([h], [d])
        assert torch.equal(got.tokens[b, :d], one.tokens[0]) and torch.equal(got.probs[b, :d], one.probs[0])
        assert (got.tokens[b, d:] == -1).all() and (got.probs[b, d:] == 0).all()
        ctx = h[-dr.window:] if dr.window else h
        want = brute_proposal(ctx, d, 1, 3, 2.0, 1.0, 3) if len(ctx) >= 2 else [[] for _ in range(d)]
        for k in range(d):
            assert [t for t in got.tokens[b, k].tolist() if t >= 0] == [x for x, _ in want[k]]


def test_ngram_prompt_lookup_copies_a_repeated_phrase():
    phrase = [11, 12, 13, 14, 15, 16]
    ctx = [1, 2] + phrase + [3, 4, 5] + phrase[:3]  # the root is 13: continue with 14, 15, 16, 3, 4
    prop = NgramDrafter(1, 4, top_k=2).propose([ctx], [5])
    assert prop.tokens[0, :, 0].tolist() == [14, 15, 16, 3, 4]
    assert (prop.probs[0, :, 0] > 0.9).all()
    starts, lengths = NgramDrafter(1, 4, top_k=2).matches(ctx)
    assert int(lengths.max()) == 3 and starts.numel() == 1
    both = NgramDrafter(1, 4, top_k=2).propose([ctx, [7]], [5, 5])
    tok, prob = both.tokens, both.probs
    assert tok.shape == (2, 5, 2) and (tok[1] == -1).all() and (prob[1] == 0).all()


def test_ngram_candidates_for_the_tree_runner():
    """The runner's view of a proposal: per depth the non-padding candidates, most probable first,
    cut at the first depth without one."""
    dr = NgramDrafter(1, 4, top_k=3)
    ctx = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]  # root 6: "5 6" continued by 7 twice, then 8 or 9
    c = dr.propose([ctx], [10])
    assert int(c.depths[0]) == 8  # the earliest match's continuation ends with the context; depths 9, 10 are padding
    assert (c.tokens[0, 8:] == -1).all()
    real = [[t for t in row if t >= 0] for row in c.tokens[0].tolist()]
    assert real[0] == [7] and sorted(real[1]) == [8, 9]
    for d in range(8):
        k = len(real[d])
        assert (c.tokens[0, d, k:] == -1).all() and (c.probs[0, d, :k] > 0).all()
        assert torch.equal(c.probs[0, d, :k], c.probs[0, d, :k].sort(descending=True).values)
    assert int(dr.propose([[1, 2, 3]], [3]).depths[0]) == 0


def test_ngram_window_and_no_match():
    dr = NgramDrafter(2, 3, top_k=4, window=4)
    assert (dr.propose([[5, 6, 7, 5, 6, 9, 9, 5, 6]], [3]).tokens == -1).all()  # match outside the window
    assert NgramDrafter(2, 3).propose([[5, 6, 7, 5, 6]], [2]).tokens[0, 0, 0] == 7
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


# ------------------------------------------------------------- draft head state bookkeeping
@pytest.mark.parametrize("builder", ["chain", "k-ary", "best-first"])
def test_head_step_fn_matches_teacher_forced_unroll(builder):
    """The builders' level-by-level calls see, at every node, the distribution the head gives
    after that node's root-to-node path (state kept by request and node id)."""
    from draft_head import DraftHead, HeadStepFn
    from vllm_bole.spec_decode.offline import build_best_first_autoregressive

    torch.manual_seed(0)
    V, H, K, B = 40, 16, 24, 3
    head = DraftHead(torch.randn(V, H), torch.randperm(V)[:K].sort().values, width=32, dropout=0.0).eval()
    torch.nn.init.normal_(head.fc2.weight, std=0.3)
    head.temps.copy_(torch.linspace(0.7, 1.5, head.temps.numel()))
    h = torch.randn(B, H)
    roots = torch.tensor([1, 5, 7])
    step = HeadStepFn(head, h, roots, bf16=False)
    if builder == "chain":
        dt = build_static(StaticTree.chain(4), roots, step_fn=step)
    elif builder == "k-ary":
        dt = build_static(StaticTree.kary(2, 6), roots, step_fn=step)
    else:
        dt = build_best_first_autoregressive(roots, step, 7, max_depth=4)
    tree, dists = dt.tree, dt.child_dists()
    for i in range(tree.num_nodes):
        if int(dt.child_dist_index[i]) < 0:
            continue
        b = int(tree.request_index[i])
        path = [int(x) for x in tree.path_flat[i] if x >= 0]
        toks = [int(roots[b])] + [int(head.shortlist[tree.token_ids[j]]) for j in path[1:]]
        one = HeadStepFn(head, h[b:b + 1], roots[b:b + 1], bf16=False)
        want = one.teacher_forced_probs(torch.tensor([toks]))[0, -1]
        assert torch.allclose(dists[i], want, atol=1e-5)
