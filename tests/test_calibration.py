"""Where trees pay (``vllm_bole.spec_decode.calibration``): node kinds and per (depth, kind) counts
against a plain Python walk of each tree (ragged random batches, chains, root-only requests); the
calibrated best-first builder against brute force over every prefix-closed tree with the calibrated
scores; the kinds it records against the tree's own; the decaying factors."""
import dataclasses
import math

import pytest
import torch

from vllm_bole.spec_decode.best_first import best_first_slots
from vllm_bole.spec_decode.calibration import (BRANCH, MAIN, MEMORY, OFF, PRIOR, Calibration, branch_columns,
                                               kind_counts, node_kinds)
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.tree import MAX_DEPTH
from vllm_bole.testing.oracles import random_accepted_paths, random_tree_batch

from test_builders import brute_force_best


def walk(tree, accepted, q):
    """[MAX_DEPTH + 1, 3, 3] (reached, accepted, expected) per (depth, kind), node by node."""
    out = torch.zeros(MAX_DEPTH + 1, 3, 3, dtype=torch.float64)
    kinds = []
    for r in range(tree.num_requests):
        par, _ = tree.request(r)
        start = int(tree.cu_nodes[r])
        acc = {int(x) for x in accepted[r] if x >= 0}
        children = {}
        for i, p in enumerate(par):
            children.setdefault(p, []).append(i)
        kind = {0: MAIN}
        for i, p in enumerate(par):
            if p >= 0:
                kind[i] = (MAIN if min(children[p]) == i else BRANCH) if kind[p] == MAIN else OFF
        kinds += [kind[i] for i in range(len(par))]
        for i, p in enumerate(par):
            if p < 0 or p not in acc or int(tree.token_ids[start + i]) < 0:  # placeholders are no drafts
                continue
            d = len(tree.root_path(r, i)) - 1
            out[d, kind[i]] += torch.tensor([1.0, float(i in acc), float(q[start + i])], dtype=torch.float64)
    return out, torch.tensor(kinds)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", ["random", "deep", "wide", "chain"])
def test_kind_counts_equal_the_walk(seed, shape):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 17, 65 if shape == "chain" else 256, 64, 5][: 3 + seed % 4]
    tree = random_tree_batch(sizes, kind=shape, generator=g, max_depth=64)
    q = torch.rand(tree.num_nodes, generator=g)
    # a fifth of the draft nodes placeholders (token -1: vLLM's padding, a padded tree's leaves)
    token = torch.where((torch.rand(tree.num_nodes, generator=g) < 0.2) & (tree.parent_flat >= 0), -1, tree.token_ids)
    tree = dataclasses.replace(tree, draft_prob=q, token_ids=token)
    accepted, _ = random_accepted_paths(tree, tree.max_depth + 1, generator=g)
    got = kind_counts(tree, accepted)
    want, kinds = walk(tree, accepted, q)
    assert torch.equal(node_kinds(tree), kinds)
    assert torch.allclose(got, want, atol=1e-9)
    cols = branch_columns(got)
    real = torch.where(accepted >= 0, token[(accepted + tree.starts[:, None]).clamp(min=0)], -1)
    assert int(cols[:, 1].sum() + cols[:, 3].sum()) == int((real >= 0).sum()) - tree.num_requests


def calibrated_weight(tokens, probs, f):
    """rho' of a path of ranks (one request's per-depth candidates, sorted): the builder's rule."""
    def score(depth, parent_kind, rank):
        row = probs[depth - 1]
        kinds = [(MAIN if r == 0 else BRANCH) if parent_kind == MAIN else OFF for r in range(len(row))]
        s = [min(float(f[depth, k]) * float(x), 1.0) for k, x in zip(kinds, row)]
        return min(s[: rank + 1]), kinds[rank]

    def w(path):
        total, kind = 1.0, MAIN
        for d, rank in enumerate(path, start=1):
            sc, kind = score(d, kind, rank)
            total *= sc
        return total
    return w


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("N", [3, 6])
def test_calibrated_best_first_is_optimal(seed, N):
    """Max sum of calibrated path scores over every prefix-closed tree (K = 3 candidates per depth,
    depth 3), the builder's kinds equal the tree's, and draft_prob keeps the drafter's q."""
    g = torch.Generator().manual_seed(seed)
    B, D, K = 3, 3, 3
    probs = (torch.randn(B, D, K, generator=g) * 1.5).softmax(-1).sort(-1, descending=True).values * 0.9
    tokens = torch.arange(K).expand(B, D, K).clone()
    f = torch.rand(MAX_DEPTH + 1, 3, generator=g) * 2.5
    s = best_first_slots(torch.zeros(B, dtype=torch.long), Candidates(tokens, probs), N, calibration=f)
    tree = s.tree()
    structural = dataclasses.replace(tree, node_kind=None)
    assert torch.equal(node_kinds(structural), s.flat("kind")) and torch.equal(tree.node_kind, s.flat("kind"))
    # kinds carried through the scheduler's selection (reordered, truncated, a placeholder row) stay structural
    sel = tree.select([2, -1, 0], [3, 4, 1])
    assert torch.equal(node_kinds(sel), node_kinds(dataclasses.replace(sel, node_kind=None)))
    assert torch.equal(sel.first_child_depth(), dataclasses.replace(sel, node_kind=None).first_child_depth())
    for b in range(B):
        got = float(s.logrho[b][s.valid[b]].exp().sum()) - 1.0  # roots excluded
        assert got == pytest.approx(brute_force_best(calibrated_weight(tokens[b], probs[b], f), K, D, N), rel=1e-6)
        par, tok = tree.request(b)
        q = tree.draft_prob[tree.cu_nodes[b]: tree.cu_nodes[b + 1]]
        dep = tree.depth[tree.cu_nodes[b]: tree.cu_nodes[b + 1]]
        for i in range(1, len(par)):
            assert float(q[i]) == pytest.approx(float(probs[b, dep[i] - 1, tok[i]]))


def test_calibration_factors_and_memory():
    c = Calibration()
    assert torch.equal(c.factors(), torch.ones(MAX_DEPTH + 1, 3))
    step = torch.zeros(MAX_DEPTH + 1, 3, 3, dtype=torch.float64)
    step[1, MAIN] = torch.tensor([10.0, 9.0, 5.0])  # the drafter is under-confident on the main path
    step[1, BRANCH] = torch.tensor([20.0, 0.0, 4.0])  # and over-confident on its siblings
    c.update(step)
    f = c.factors()
    assert float(f[1, MAIN]) == pytest.approx((9 + PRIOR) / (5 + PRIOR))
    assert float(f[1, BRANCH]) == pytest.approx(PRIOR / (4 + PRIOR)) and float(f[2, OFF]) == 1.0
    rates = c.rates(2)
    assert rates["main"]["rate"] == [0.9, None] and rates["branch"]["rate"] == [0.0, None]
    big = torch.zeros_like(step)
    big[3, OFF] = torch.tensor([1.0, 1.0, MEMORY + 1])
    c.update(big)
    assert float(c.counts[3, OFF, 2]) == pytest.approx((MEMORY + 1) / 2)  # halved
    assert float(c.counts[1, MAIN, 2]) == 5.0  # other buckets keep theirs
    assert not math.isnan(float(c.factors().sum()))
