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


# ------------------------------------------------------------------ select / draft tokens
_FIELDS = ("token_ids", "parent", "depth", "cu_nodes", "path", "anc_mask")


def _assert_same(a: TreeBatch, b: TreeBatch):
    for f in _FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
    assert a.max_nodes == b.max_nodes


@pytest.mark.parametrize("seed", range(6))
def test_select_equals_rebuilding_the_truncated_trees(seed):
    """select(rows, num_nodes) gives exactly the batch from_parents builds from the kept prefixes
    (with repeats, reordering, placeholders and replaced roots)."""
    rng = random.Random(200 + seed)
    sizes = [1, MAX_NODES] + [rng.randint(1, 40) for _ in range(6)]
    parents = [_random_parents(n, rng, max_depth=rng.choice([None, 3])) for n in sizes]
    tokens = [[rng.randrange(1000) for _ in p] for p in parents]
    tb = TreeBatch.from_parents(parents, tokens)
    rows = [rng.randrange(-1, len(sizes)) for _ in range(rng.randint(1, 12))]
    n = [rng.randint(1, sizes[r]) if r >= 0 else rng.randint(1, 40) for r in rows]
    roots = [rng.randrange(1000) for _ in rows]
    want_p = [parents[r][:k] if r >= 0 else [-1] + [0] * (k - 1) for r, k in zip(rows, n)]
    want_t = [tokens[r][:k] if r >= 0 else [-1] * k for r, k in zip(rows, n)]
    _assert_same(tb.select(rows, n), TreeBatch.from_parents(want_p, want_t))
    replaced = [[x] + t[1:] for x, t in zip(roots, want_t)]
    _assert_same(tb.select(rows, n, root_tokens=roots), TreeBatch.from_parents(want_p, replaced))
    real = [r for r in rows if r >= 0] or [0]
    _assert_same(tb.select(real), TreeBatch.from_parents([parents[r] for r in real], [tokens[r] for r in real]))
    _assert_same(tb.select(real, 1), TreeBatch.from_parents([[-1]] * len(real), [[tokens[r][0]] for r in real]))
    every = list(range(len(sizes)))  # the whole batch as drafted, new roots (the runner's usual step)
    _assert_same(tb.select(every, sizes, root_tokens=roots[:1] * len(sizes)),
                 TreeBatch.from_parents(parents, [[roots[0]] + t[1:] for t in tokens]))


def test_select_errors():
    tb = TreeBatch.from_parents([[-1, 0, 1], [-1]])
    with pytest.raises(TreeError, match="rows"):
        tb.select([2])
    with pytest.raises(TreeError, match="rows"):
        tb.select([])
    with pytest.raises(TreeError, match="num_nodes"):
        tb.select([0, 1], [3, 2])  # request 1 has one node
    with pytest.raises(TreeError, match="num_nodes"):
        tb.select([0], [0])
    with pytest.raises(TreeError, match="num_nodes"):
        tb.select([-1], [MAX_NODES + 1])


def _chain_len(par, tok):
    """The runner's first-child chain length, one node at a time (reference)."""
    depth, node = 0, 0
    while True:
        kids = [j for j in range(node + 1, len(par)) if par[j] == node and tok[j] >= 0]
        if not kids:
            return depth
        node, depth = kids[0], depth + 1


@pytest.mark.parametrize("seed", range(4))
def test_draft_token_ids_and_first_child_depth(seed):
    rng = random.Random(300 + seed)
    parents = [_random_parents(rng.randint(1, 30), rng) for _ in range(9)]
    tokens = [[rng.choice([-1, 1, 2, 3]) for _ in p] for p in parents]
    tb = TreeBatch.from_parents(parents, tokens)
    assert tb.draft_token_ids() == [t[1:] for t in tokens]
    assert tb.first_child_depth().tolist() == [_chain_len(p, t) for p, t in zip(parents, tokens)]


def test_pack_unpack_round_trip():
    """``transfer.upload_many``'s packing (its CUDA path: one staging buffer, 8-byte aligned views):
    every dtype, shape and empty tensor comes back equal, from a buffer or from a view into one."""
    from vllm_bole.transfer import pack, unpack

    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(-9, 9, (5, 3), generator=g), torch.randint(0, 9, (7,), generator=g).int(), torch.rand(3, 2),
          torch.zeros(0, 4, dtype=torch.int64), torch.rand(4) > 0.5, torch.randint(0, 9, (3,), generator=g).short()[::2],
          torch.rand(3, 3).bfloat16()[:, 1], torch.rand(5).half()]
    buf, spans = pack(ts)
    assert buf.dtype == torch.uint8 and all(o % 8 == 0 for o, _ in spans)
    inner = torch.zeros(buf.numel() + 16, dtype=torch.uint8)[16:]  # a buffer that is itself a view (offset 16)
    inner.copy_(buf)
    for staged in (buf, inner):
        for a, b in zip(ts, unpack(staged, ts, spans)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and b.is_contiguous()
