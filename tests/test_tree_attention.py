"""Tree attention over a paged KV cache and accepted-path KV compaction (issue 5).

Every node's output must equal dense float64 attention over its request's prefix plus its
root-to-node path (``attention_tree_reference``); after compaction the cache must hold exactly
what autoregressive decoding of the accepted path would have written, and nothing else may
change. Both the torch path and the Triton kernels are checked: the kernels natively on CUDA,
on CPU through Triton's interpreter (TRITON_INTERPRET=1, set by CI before triton is imported;
fp32 there, since the interpreter's bf16 dot is wrong). Shapes stay tiny: the interpreter is
slow.
"""
from __future__ import annotations

import os

import pytest
import torch

from vllm_bole.attention import (
    accepted_path,
    compact_accepted_kv,
    tree_attention,
    tree_positions,
    tree_slot_mapping,
    write_tree_kv,
)
from vllm_bole.attention.kv_compaction.reference import compaction_reference
from vllm_bole.attention.tree_attention.naive import prefix_attention_torch
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.testing.oracles import (
    attention_tree_reference,
    make_tree_shape,
    random_tree,
    random_tree_batch,
    tree_shapes,
)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
RUN_TRITON = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not RUN_TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")
KERNELS = ["torch", pytest.param("triton", marks=needs_triton)]


# ------------------------------------------------------------------------------------ fixtures
def _prefix_lens(B: int, gen: torch.Generator, bs: int) -> torch.Tensor:
    """Prefix lengths cycling through 0, non-multiples and multiples of the block size."""
    choices = [0, 2 * bs + 5, bs, 3, 3 * bs - 1, 2 * bs]
    off = int(torch.randint(len(choices), (1,), generator=gen))
    return torch.tensor([choices[(off + b) % len(choices)] for b in range(B)], dtype=torch.int32)


def _make_caches(num_blocks, bs, Hkv, D, dtype, layout, num_layers, gen):
    """Random-filled per-layer (key_cache, value_cache) views in one of vLLM's layouts."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if layout == "unbind":  # vLLM 0.33: [num_blocks, 2, block_size, Hkv, D], unbind(1)
        raws = [rnd(num_blocks, 2, bs, Hkv, D) for _ in range(num_layers)]
        pairs = [r.unbind(1) for r in raws]
    elif layout == "packed":  # vLLM's logical per-layer cache of FLASH_ATTN / TRITON_ATTN / FLASHINFER
        # (0.32, 0.33): [num_blocks, Hkv, block_size, 2D], split as the adapter's paged_kv_views does
        raws = [rnd(num_blocks, Hkv, bs, 2 * D) for _ in range(num_layers)]
        pairs = [tuple(r.transpose(1, 2).split(D, dim=-1)) for r in raws]
    elif layout == "shared":  # all layers as views of one buffer [L, 2, num_blocks, bs, Hkv, D]
        raw = rnd(num_layers, 2, num_blocks, bs, Hkv, D)
        raws = [raw]
        pairs = [(raw[i, 0], raw[i, 1]) for i in range(num_layers)]
    else:
        raise ValueError(layout)
    return [p[0] for p in pairs], [p[1] for p in pairs], raws


def make_case(
    tree, *, Hq=4, Hkv=2, D=32, bs=16, layout="unbind", dtype=torch.float32, num_layers=1, seed=0, device=DEV
):
    """A batch with its prefixes and tree K/V written into randomly placed, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    B, T = tree.num_requests, tree.num_nodes
    P = _prefix_lens(B, gen, bs)
    sizes = tree.nodes_per_request
    nblk = [(int(p) + int(n) + bs - 1) // bs for p, n in zip(P, sizes)]
    num_blocks = sum(nblk) + 3  # spare blocks that must stay untouched
    perm = torch.randperm(num_blocks, generator=gen)
    # Unused block-table entries point far out of range: reading them would fail loudly.
    bt = torch.full((B, max(nblk) + 2), 1 << 20, dtype=torch.int32)
    c = 0
    for b in range(B):
        bt[b, : nblk[b]] = perm[c : c + nblk[b]]
        c += nblk[b]
    kcs, vcs, raws = _make_caches(num_blocks, bs, Hkv, D, dtype, layout, num_layers, gen)
    k_prefix = [[torch.randn(int(p), Hkv, D, generator=gen).to(dtype) for p in P] for _ in range(num_layers)]
    v_prefix = [[torch.randn(int(p), Hkv, D, generator=gen).to(dtype) for p in P] for _ in range(num_layers)]
    for layer in range(num_layers):
        for b in range(B):
            pos = torch.arange(int(P[b]))
            blk = bt[b].long()[pos // bs]
            kcs[layer][blk, pos % bs] = k_prefix[layer][b]
            vcs[layer][blk, pos % bs] = v_prefix[layer][b]
    q = torch.randn(T, Hq, D, generator=gen).to(dtype)
    k = [torch.randn(T, Hkv, D, generator=gen).to(dtype) for _ in range(num_layers)]
    v = [torch.randn(T, Hkv, D, generator=gen).to(dtype) for _ in range(num_layers)]
    slots = tree_slot_mapping(tree, P, bt, bs)
    for layer in range(num_layers):
        write_tree_kv(k[layer], v[layer], kcs[layer], vcs[layer], slots)
    mv = lambda x: x.to(device)  # noqa: E731
    if device.type != "cpu":
        raws = [mv(r) for r in raws]
        kcs, vcs, _ = _rebuild_views(raws, layout, num_layers, D)
    return dict(
        tree=tree.to(device), P=mv(P), bt=mv(bt), bs=bs, kcs=kcs, vcs=vcs, raws=raws, q=mv(q),
        k=[mv(x) for x in k], v=[mv(x) for x in v], k_prefix=k_prefix, v_prefix=v_prefix, tree_cpu=tree,
    )


def _rebuild_views(raws, layout, num_layers, D):
    if layout == "unbind":
        pairs = [r.unbind(1) for r in raws]
    elif layout == "packed":
        pairs = [tuple(r.transpose(1, 2).split(D, dim=-1)) for r in raws]
    else:
        pairs = [(raws[0][i, 0], raws[0][i, 1]) for i in range(num_layers)]
    return [p[0] for p in pairs], [p[1] for p in pairs], raws


def _check_attention(case, kernels, *, scale=None, tol=2e-5, **kw):
    q = case["q"]
    out = torch.full_like(q, float("nan"))  # poison: unwritten elements fail
    res = tree_attention(
        q, case["kcs"][0], case["vcs"][0], case["bt"], case["P"], case["tree"],
        scale=scale, out=out, kernels=kernels, **kw,
    )
    assert res is out
    ref = attention_tree_reference(
        case["tree_cpu"], q.cpu(), case["k"][0].cpu(), case["v"][0].cpu(), case["k_prefix"][0], case["v_prefix"][0],
        scale=scale,
    )
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "unwritten or non-finite outputs"
    err = (got - ref).abs().max().item()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert err < tol * max(1.0, ref.abs().max().item()) and rel < tol, (err, rel)


# ------------------------------------------------------------------------------ positions/slots
def test_positions_and_slot_mapping():
    tree = make_tree_shape("ragged", seed=3)
    case = make_case(tree, device=torch.device("cpu"))
    P, bt, bs = case["P"], case["bt"], case["bs"]
    pos = tree_positions(tree, P)
    slots = tree_slot_mapping(tree, P, bt, bs)
    cu = tree.cu_nodes.tolist()
    for b in range(tree.num_requests):
        for j, i in enumerate(range(cu[b], cu[b + 1])):
            assert pos[i].item() == int(P[b]) + int(tree.depth[i])
            p = int(P[b]) + j  # flat node order
            assert slots[i].item() == int(bt[b, p // bs]) * bs + p % bs
    assert pos.dtype == slots.dtype == torch.int64
    assert len(set(slots.tolist())) == tree.num_nodes


# --------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("shape", tree_shapes())
@pytest.mark.parametrize("kernels", KERNELS)
def test_tree_attention_shapes(shape, kernels):
    """Every standard tree family (chains, stars, deep 16, wide, ragged with root-only requests)."""
    tree = make_tree_shape(shape, seed=11)
    layout = "packed" if len(shape) % 2 else "unbind"
    case = make_case(tree, Hq=4, Hkv=2, D=32, layout=layout, seed=len(shape))
    _check_attention(case, kernels)


@pytest.mark.parametrize(
    "Hq,Hkv,D,bs,kw",
    [
        (6, 2, 24, 16, {}),  # non power-of-two group and head dim (padded)
        (4, 4, 32, 32, {}),  # MHA, bigger pages
        (8, 1, 32, 16, {"scale": 0.3}),  # one kv head, group of 8 (Qwen3-Next ratio), custom scale
        (4, 2, 64, 16, {"num_splits": 3}),  # split-K with reduction
        (4, 2, 32, 16, {"block_m": 16, "block_n": 32}),  # several query blocks per request
        (4, 2, 32, 16, {"block_m": 16, "block_n": 16, "swap": True}),  # kernel form with swapped operands
        (6, 2, 24, 16, {"block_m": 32, "block_n": 16, "swap": True, "num_splits": 2}),
        # the prefix's attention computed apart (FlashAttention on the GPU; here its torch stand-in), the kernel
        # continuing it over the tree's keys: prefixes of 0 keys (lse +inf) and tails starting inside a tile
        (4, 2, 32, 16, {"prefix_attention": prefix_attention_torch}),
        (8, 1, 24, 16, {"prefix_attention": prefix_attention_torch, "block_m": 16, "swap": True}),
    ],
)
@pytest.mark.parametrize("kernels", KERNELS)
def test_tree_attention_heads_and_tiles(Hq, Hkv, D, bs, kw, kernels):
    gen = torch.Generator().manual_seed(Hq * 100 + D)
    tree = random_tree_batch([1, 13, 6, 22], kind=["chain", "random", "star", "deep"], generator=gen)
    case = make_case(tree, Hq=Hq, Hkv=Hkv, D=D, bs=bs, layout="packed", seed=D)
    scale = kw.pop("scale", None)
    if kernels == "torch":
        kw = {}
    _check_attention(case, kernels, scale=scale, **kw)


# ---------------------------------------------------------------------------------- compaction
def _accepted(tree: TreeBatch, modes: list[str], gen: torch.Generator) -> torch.Tensor:
    """Accepted path per request: "root" only, the "deepest" path, the path to the "last" node
    (jumps over siblings: overlapping moves) or to a "random" node."""
    cu = tree.cu_nodes.tolist()
    last = []
    for b, mode in enumerate(modes):
        n = cu[b + 1] - cu[b]
        last.append(
            {
                "root": 0,
                "deepest": int(torch.argmax(tree.depth[cu[b] : cu[b + 1]])),
                "last": n - 1,
                "random": int(torch.randint(n, (1,), generator=gen)),
            }[mode]
        )
    return accepted_path(tree, torch.tensor(last))


@pytest.mark.parametrize("layout", ["unbind", "packed", "shared"])
@pytest.mark.parametrize("kernels", KERNELS)
def test_compaction_matches_autoregressive_cache(layout, kernels):
    gen = torch.Generator().manual_seed(7)
    parents = [random_tree(n, kind=k, generator=gen, max_depth=16)
               for n, k in [(9, "chain"), (1, "chain"), (30, "random"), (17, "deep"), (40, "deep"), (5, "star")]]
    parents.append([-1, 0, 0, 2, 2, 4, 3, 6, 0, 7, 9])  # accepted 0-2-3-6-7-9-10: chained overlaps
    tree = TreeBatch.from_parents(parents)
    L = 3
    case = make_case(tree, Hq=4, Hkv=2, D=32, bs=16, layout=layout, num_layers=L, seed=5)
    acc = _accepted(tree, ["deepest", "root", "last", "random", "last", "random", "last"], gen)
    assert (acc[:, 0] == 0).all()
    P, bt, bs = case["P"].cpu(), case["bt"].cpu(), case["bs"]
    # What autoregressive decoding of the accepted tokens writes: the path's K/V at P .. P+m-1
    # on top of the current cache (positions < P and all other slots unchanged).
    expected_k = [c.detach().cpu().clone() for c in case["kcs"]]
    expected_v = [c.detach().cpu().clone() for c in case["vcs"]]
    cu = tree.cu_nodes.tolist()
    moved = 0
    for b in range(tree.num_requests):
        path = [x for x in acc[b].tolist() if x >= 0]
        assert path == sorted(path)
        for j, node in enumerate(path):
            p = int(P[b]) + j
            blk, off = int(bt[b, p // bs]), p % bs
            for layer in range(L):
                expected_k[layer][blk, off] = case["k"][layer][cu[b] + node].cpu()
                expected_v[layer][blk, off] = case["v"][layer][cu[b] + node].cpu()
            moved += node != j
    assert moved > 5, "the test should move overlapping rows"
    raw_before = [r.cpu().clone() for r in case["raws"]]
    ref = compaction_reference(case["kcs"] + case["vcs"], case["bt"], case["P"], acc)
    assert all(torch.equal(a, b) for a, b in zip(ref, expected_k + expected_v)), "the sequential reference"
    compact_accepted_kv(case["kcs"], case["vcs"], case["bt"], case["P"], acc.to(DEV), kernels=kernels)
    for layer in range(L):
        assert torch.equal(case["kcs"][layer].cpu(), expected_k[layer]), f"layer {layer} keys"
        assert torch.equal(case["vcs"][layer].cpu(), expected_v[layer]), f"layer {layer} values"
    # Nothing outside the K/V views changed (e.g. packed padding, spare blocks are inside views).
    changed = sum(int((r.cpu() != r0).sum()) for r, r0 in zip(case["raws"], raw_before))
    assert changed <= moved * 2 * L * case["kcs"][0].shape[2] * case["kcs"][0].shape[3]


@pytest.mark.parametrize("kernels", KERNELS)
def test_compaction_then_attention_equals_chain(kernels):
    """After compaction, attending with the accepted path as a chain over the compacted cache
    gives the tree pass's outputs for those nodes (what the next AR step would see)."""
    gen = torch.Generator().manual_seed(21)
    tree = random_tree_batch([12, 25, 1], kind=["random", "deep", "chain"], generator=gen)
    case = make_case(tree, Hq=4, Hkv=2, D=32, layout="unbind", seed=9)
    q = case["q"]
    out_tree = tree_attention(q, case["kcs"][0], case["vcs"][0], case["bt"], case["P"], case["tree"], kernels=kernels)
    cu = tree.cu_nodes.tolist()
    last = torch.tensor([e - s - 1 for s, e in zip(cu[:-1], cu[1:])])  # path to the last node: moves rows
    acc = accepted_path(tree, last)
    compact_accepted_kv(case["kcs"], case["vcs"], case["bt"], case["P"], acc.to(DEV), kernels=kernels)
    paths = [[x for x in row if x >= 0] for row in acc.tolist()]
    assert any(p != list(range(len(p))) for p in paths)
    chain = TreeBatch.from_parents([list(range(-1, len(p) - 1)) for p in paths])
    flat = torch.tensor([cu[b] + x for b, p in enumerate(paths) for x in p])
    out_chain = tree_attention(
        q[flat.to(q.device)].contiguous(), case["kcs"][0], case["vcs"][0], case["bt"], case["P"], chain.to(DEV),
        kernels=kernels,
    )
    torch.testing.assert_close(out_chain.cpu(), out_tree[flat.to(q.device)].cpu(), rtol=1e-5, atol=1e-5)


def test_bad_kernels_is_rejected():
    tree = TreeBatch.from_parents([[-1, 0]], [[1, 2]])
    cache = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of"):
        tree_attention(torch.zeros(2, 1, 8), cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int32), tree, kernels="cuda")
    with pytest.raises(ValueError, match="kernels: 'cuda' is not one of"):
        compact_accepted_kv(cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                            torch.tensor([[0, 1]], dtype=torch.int32), kernels="cuda")


@pytest.mark.parametrize("kernels", KERNELS)
def test_queries_on_part_of_the_tree(kernels):
    """``num_keys``: queries for only some nodes of each request's tree (a tree drafter's newest level)
    over all of its nodes' keys, each row by its own ancestor bits: equal to those rows of the
    whole tree's attention (the reference), whatever subset is asked (empty subsets included)."""
    gen = torch.Generator().manual_seed(3)
    tree = random_tree_batch([5, 40, 1, 17], kind="random", generator=gen)
    case = make_case(tree, seed=4)
    ref = attention_tree_reference(tree, case["q"].cpu(), case["k"][0].cpu(), case["v"][0].cpu(),
                                   case["k_prefix"][0], case["v_prefix"][0])
    sizes = tree.nodes_per_request.tolist()
    pick = [sorted(torch.randperm(n, generator=gen)[: max(0, n // 2 - 1)].tolist()) for n in sizes]
    rows = torch.tensor([int(tree.cu_nodes[b]) + j for b, js in enumerate(pick) for j in js], dtype=torch.long)
    cu = torch.zeros(len(pick) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([len(js) for js in pick]).cumsum(0)

    class Part:  # the kernel's view: query rows, their ancestor bits over the request's whole tree
        cu_nodes, anc_mask, max_nodes = cu.to(DEV), tree.anc_mask[rows].to(DEV), max(map(len, pick))

    q = case["q"][rows.to(DEV)]
    out = torch.full_like(q, float("nan"))
    tree_attention(q, case["kcs"][0], case["vcs"][0], case["bt"], case["P"], Part, out=out, kernels=kernels,
                   num_keys=tree.nodes_per_request.to(torch.int32).to(DEV))
    got = out.cpu().double()
    assert torch.isfinite(got).all() and torch.allclose(got, ref[rows], atol=2e-5 * max(1.0, ref.abs().max().item()))


def test_flash_prefix_supports_only_what_flashattention_takes():
    """The FlashAttention prefix only for fp16/bf16 queries over a cache of their dtype and heads up to 256:
    an fp32 engine (FlashAttention refuses fp32) keeps the Triton prefix."""
    from vllm_bole.adapter import flash_prefix

    q, cache = torch.zeros(3, 4, 128), torch.zeros(2, 16, 1, 128)
    assert flash_prefix.supports(q.bfloat16(), cache.bfloat16()) and flash_prefix.supports(q.half(), cache.half())
    assert not flash_prefix.supports(q, cache)
    assert not flash_prefix.supports(q.bfloat16(), cache.half())
    assert not flash_prefix.supports(torch.zeros(3, 4, 512, dtype=torch.bfloat16),
                                     torch.zeros(2, 16, 1, 512, dtype=torch.bfloat16))
