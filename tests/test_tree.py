"""TreeBatch: constructors, derived ancestor relations and validation errors."""
import random

import pytest
import torch

from vllm_bole.spec_decode import MAX_DEPTH, MAX_NODES, TreeBatch, TreeError


def _random_parents(n, rng, max_depth=None):
    par, depth = [-1], [0]
    for i in range(1, n):
        choices = [j for j in range(i) if max_depth is None or depth[j] < max_depth]
        p = rng.choice(choices)
        par.append(p)
        depth.append(depth[p] + 1)
    return par


def _naive_ancestors(par, i):
    out = []
    while i >= 0:
        out.append(i)
        i = par[i]
    return out[::-1]  # root first


@pytest.mark.parametrize("seed", range(5))
def test_path_depth_mask_match_naive_walk(seed):
    rng = random.Random(seed)
    sizes = [1, rng.randint(2, 40), MAX_NODES, rng.randint(2, 40)]
    parents = [_random_parents(n, rng) for n in sizes]
    # a full-size request with one path at the depth limit
    parents[2] = [-1] + list(range(MAX_DEPTH)) + [rng.randrange(MAX_DEPTH) for _ in range(MAX_NODES - MAX_DEPTH - 1)]
    tokens = [[rng.randrange(1000) for _ in p] for p in parents]
    tb = TreeBatch.from_parents(parents, tokens)
    assert tb.num_requests == 4 and tb.num_nodes == sum(sizes)
    assert tb.cu_nodes.tolist() == [0] + list(torch.cumsum(torch.tensor(sizes), 0).tolist())
    assert tb.max_depth == MAX_DEPTH
    for r, par in enumerate(parents):
        s = int(tb.cu_nodes[r])
        assert tb.request(r) == (par, tokens[r])
        for i in range(len(par)):
            anc = _naive_ancestors(par, i)
            assert int(tb.depth[s + i]) == len(anc) - 1
            row = tb.path[s + i].tolist()
            assert row[: len(anc)] == anc and all(x == -1 for x in row[len(anc):])
            assert tb.path_flat[s + i, : len(anc)].tolist() == [a + s for a in anc]
            j = torch.arange(len(par))
            got = tb.is_ancestor(torch.full_like(j, s + i), j).tolist()
            assert got == [jj in anc for jj in range(len(par))]
        assert tb.parent_flat[s : s + len(par)].tolist() == [p + s if p >= 0 else -1 for p in par]
    assert tb.request_index.tolist() == sum(([r] * n for r, n in enumerate(sizes)), [])


def test_high_bits_of_mask_words():
    # node 255 on a chain touching bit 31 of several words: sign bits must round-trip
    par = [-1] + list(range(MAX_DEPTH)) + [31] * (MAX_NODES - MAX_DEPTH - 1)
    tb = TreeBatch.from_parents([par])
    i = torch.tensor([MAX_NODES - 1] * 3)
    assert tb.is_ancestor(i, torch.tensor([31, 32, MAX_NODES - 1])).tolist() == [True, False, True]
    assert tb.anc_mask.dtype == torch.int32 and tb.anc_mask.shape == (MAX_NODES, MAX_NODES // 32)


def test_max_depth_padding_and_limits():
    tb = TreeBatch.from_parents([[-1, 0, 1]], max_depth=8)
    assert tb.path.shape == (3, 9)
    with pytest.raises(TreeError, match="max_depth"):
        TreeBatch.from_parents([[-1, 0, 1]], max_depth=1)


def test_from_token_paths_merges_prefixes():
    tb = TreeBatch.from_token_paths([7, 9], [[[1, 2, 3], [1, 2, 4], [5]], []])
    par, tok = tb.request(0)
    assert par == [-1, 0, 1, 2, 2, 0] and tok == [7, 1, 2, 3, 4, 5]
    assert tb.request(1) == ([-1], [9])


def test_reorder_sorts_topologically_and_keeps_tokens():
    # node 0 is a leaf, the root is node 2
    par, tok = [3, 2, -1, 2], [30, 21, 7, 23]
    tb = TreeBatch.from_parents([par], [tok], reorder=True)
    p, t = tb.request(0)
    assert t[0] == 7
    # every token keeps its parent's token
    parent_tok = {tok[i]: (tok[par[i]] if par[i] >= 0 else None) for i in range(4)}
    assert {t[i]: (t[p[i]] if p[i] >= 0 else None) for i in range(4)} == parent_tok
    assert all(p[i] < i for i in range(1, 4))


@pytest.mark.parametrize(
    "parents,kwargs,match",
    [
        ([], {}, "empty batch"),
        ([[-1], []], {}, r"parents\[1\]: empty tree"),
        ([[-1, 0, 3, 1]], {}, r"parents\[0\]\[2\] = 3: a parent must come before its child"),
        ([[0, -1]], {}, r"parents\[0\]\[0\]: the root must have parent -1"),
        ([[-1, -1]], {}, r"parents\[0\]\[1\] = -1"),
        ([[-1, 0], [-1, 5]], {}, r"parents\[1\]\[1\] = 5"),
        ([[-1, 2, 1]], {"reorder": True}, r"parents\[0\]: nodes \[1, 2\] are not reachable from the root \(cycle\)"),
        ([[-1, -1]], {"reorder": True}, "exactly one root"),
        ([[1, 0]], {"reorder": True}, "exactly one root"),
        ([[-1, 7]], {"reorder": True}, "out of range"),
        ([[-1] + list(range(MAX_DEPTH + 1))], {}, f"depth over the limit of {MAX_DEPTH}"),
        ([[-1] + [0] * MAX_NODES], {}, f"over the limit of {MAX_NODES}"),
    ],
)
def test_validation_errors(parents, kwargs, match):
    with pytest.raises(TreeError, match=match):
        TreeBatch.from_parents(parents, **kwargs)


def test_token_count_mismatch_and_flat_cu_nodes():
    with pytest.raises(TreeError, match=r"token_ids\[0\]"):
        TreeBatch.from_parents([[-1, 0]], [[1]])
    with pytest.raises(TreeError, match="cu_nodes"):
        TreeBatch.from_flat(torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.tensor([0, 3]))
    tb = TreeBatch.from_flat(torch.tensor([-1, 0, -1]), torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
    assert tb.depth.tolist() == [0, 1, 0]
