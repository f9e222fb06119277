"""Float64 oracles and tree fixtures for the kernel tests.

The float64 sequential references live beside their kernels and torch twins, one per operation
(re-exported here for tests and benchmarks):
  gdn_gating, gdn_tree_reference    vllm_bole/gdn/reference.py
  ssd_tree_reference                vllm_bole/mamba/ssd_tree/reference.py
  mamba1_tree_reference             vllm_bole/mamba/mamba1_tree/reference.py
  conv_tree_reference               vllm_bole/mamba/tree_conv/reference.py
  attention_tree_reference          vllm_bole/attention/tree_attention/reference.py
Each walks the tree with the plain per-token recurrence, depth level by depth level: every node
gets exactly what a sequential run along its own root-to-node path gives (conventions in each
module's docstring). Trees are ``TreeBatch``es (flat nodes, ``cu_nodes``).

Tree helpers: ``chain_tree``, ``random_tree``, ``random_tree_batch``, ``random_accepted_paths``,
``deepest_accepted_paths``,
``strided`` and the standard test families ``TREE_SHAPES`` / ``tree_shapes()`` /
``make_tree_shape()`` for kernel tests; ``search_cases`` for the best-first search kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from vllm_bole.attention.tree_attention.reference import attention_tree_reference
from vllm_bole.gdn.reference import gdn_gating, gdn_tree_reference
from vllm_bole.mamba.mamba1_tree.reference import mamba1_tree_reference
from vllm_bole.mamba.ssd_tree.reference import ssd_tree_reference
from vllm_bole.mamba.tree_conv.reference import conv_tree_reference
from vllm_bole.spec_decode.tree import TreeBatch

__all__ = [
    "gdn_gating",
    "gdn_tree_reference",
    "ssd_tree_reference",
    "mamba1_tree_reference",
    "conv_tree_reference",
    "attention_tree_reference",
    "chain_tree",
    "random_tree",
    "random_tree_batch",
    "TREE_KINDS",
    "TREE_SHAPES",
    "tree_shapes",
    "make_tree_shape",
    "random_accepted_paths",
    "deepest_accepted_paths",
    "strided",
    "search_cases",
]


# -------------------------------------------------------------------------------- tree builders
TREE_KINDS = ("random", "chain", "star", "deep", "wide")


def random_accepted_paths(tree: TreeBatch, width: int, generator=None) -> tuple[Tensor, Tensor]:
    """A random root-to-node path per request, as verification reports it: ``accepted``
    ``[B, width]`` int64 local indices, root first, -1 padded, and ``last`` ``[B]`` the flat index
    of each path's last node."""
    B = tree.num_requests
    accepted = torch.full((B, width), -1, dtype=torch.int64)
    last = torch.empty(B, dtype=torch.int64)
    for r in range(B):
        node = _randint(int(tree.nodes_per_request[r]), generator)
        path = tree.root_path(r, node)
        accepted[r, : len(path)] = torch.tensor(path)
        last[r] = int(tree.cu_nodes[r]) + node
    return accepted, last


def deepest_accepted_paths(tree: TreeBatch) -> tuple[Tensor, Tensor]:
    """Each request's path to its deepest node, as verification reports it: ``accepted``
    ``[B, max_depth + 1]`` int64 local indices, root first, -1 padded, and ``last`` ``[B]`` the
    flat index of each path's last node (the longest pending paths a commit can see)."""
    cu = tree.cu_nodes.tolist()
    ends = [int(torch.argmax(tree.depth[s:e])) for s, e in zip(cu[:-1], cu[1:])]
    accepted = torch.full((tree.num_requests, tree.max_depth + 1), -1, dtype=torch.int64)
    for r, node in enumerate(ends):
        path = tree.root_path(r, node)
        accepted[r, : len(path)] = torch.tensor(path)
    return accepted, torch.tensor([c + node for c, node in zip(cu[:-1], ends)])


def strided(t: Tensor) -> Tensor:
    """A non-contiguous view holding ``t``'s values (rows padded in memory), as the slices of a fused
    projection that vLLM hands to the layers."""
    wide = torch.cat([t, torch.full_like(t, float("nan"))], dim=-1)
    return wide[..., : t.shape[-1]]


def chain_tree(n: int, batch: int = 1) -> TreeBatch:
    """``batch`` requests, each a chain of ``n`` nodes (root included); token ids are 0."""
    return TreeBatch.from_parents([list(range(-1, n - 1))] * batch)


def _randint(high: int, generator) -> int:
    return int(torch.randint(high, (1,), generator=generator))


def random_tree(num_nodes: int, *, max_depth=None, kind="random", generator=None) -> list[int]:
    """Parent array (topological, root 0 with parent -1) of one request's tree of ``num_nodes``.

    kind: "random" (uniform random recursive tree), "chain", "star" (all children of the root),
    "deep" (a spine to ``max_depth`` — ``num_nodes // 2`` by default — plus random branches),
    "wide" (depth <= 2, many siblings). ``max_depth`` caps every kind (chain/star fail if they
    cannot fit).
    """
    if kind not in TREE_KINDS:
        raise ValueError(f"kind {kind!r} not in {TREE_KINDS}")
    if num_nodes < 1:
        raise ValueError("num_nodes must be >= 1 (the root)")
    cap = num_nodes if max_depth is None else int(max_depth)
    if num_nodes > 1 and cap < 1 or kind == "chain" and num_nodes - 1 > cap:
        raise ValueError(f"a {kind} tree of {num_nodes} nodes does not fit max_depth={max_depth}")
    spine = min(num_nodes - 1, cap if max_depth is not None else num_nodes // 2)
    parents, depth = [-1], [0]
    for i in range(1, num_nodes):
        if kind == "chain" or (kind == "deep" and i <= spine):
            p = i - 1
        elif kind == "star":
            p = 0
        else:
            limit = min(cap, 2) if kind == "wide" else cap
            cand = [j for j in range(i) if depth[j] < limit]
            p = cand[_randint(len(cand), generator)]
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def random_tree_batch(
    sizes: list[int], *, kind="random", generator=None, token_vocab=None, max_depth=None
) -> TreeBatch:
    """A ragged batch with one ``random_tree`` per entry of ``sizes``.

    ``kind`` is one kind for all requests or a sequence with one kind per request. Token ids are
    0 unless ``token_vocab`` is given: then roots and nodes get random ids in [0, token_vocab),
    distinct among siblings (as a draft tree's children are). ``max_depth`` caps every tree.
    """
    kinds = [kind] * len(sizes) if isinstance(kind, str) else list(kind)
    if len(kinds) != len(sizes):
        raise ValueError(f"{len(kinds)} kinds for {len(sizes)} requests")
    parents = [random_tree(n, max_depth=max_depth, kind=kd, generator=generator) for n, kd in zip(sizes, kinds)]
    tokens = None
    if token_vocab is not None:
        tokens = []
        for par in parents:
            tok = [0] * len(par)
            tok[0] = _randint(token_vocab, generator)
            for p in range(len(par)):
                kids = [i for i in range(len(par)) if par[i] == p]
                if len(kids) > token_vocab:
                    raise ValueError(f"token_vocab={token_vocab} < {len(kids)} siblings")
                for i, t in zip(kids, torch.randperm(token_vocab, generator=generator)[: len(kids)].tolist()):
                    tok[i] = t
            tokens.append(tok)
    return TreeBatch.from_parents(parents, tokens)


# The standard tree families for kernel tests: name -> random_tree_batch arguments.
TREE_SHAPES: dict[str, dict] = {
    "root_only": dict(sizes=[1, 1], kind="chain"),
    "chain": dict(sizes=[9], kind="chain"),
    "chains_batch": dict(sizes=[5, 1, 12], kind="chain"),
    "star": dict(sizes=[17], kind="star"),
    "deep16": dict(sizes=[40], kind="deep", max_depth=16),
    "wide": dict(sizes=[48], kind="wide"),
    "random": dict(sizes=[24], kind="random"),
    "ragged": dict(sizes=[1, 20, 1, 7, 33], kind=["chain", "random", "star", "deep", "wide"]),
}


def tree_shapes() -> list[str]:
    """Names of the standard tree families (for ``pytest.mark.parametrize``)."""
    return list(TREE_SHAPES)


def make_tree_shape(name: str, seed: int = 0, *, token_vocab=None) -> TreeBatch:
    """Build the standard family ``name`` deterministically from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return random_tree_batch(**TREE_SHAPES[name], generator=gen, token_vocab=token_vocab)


# (requests, depth levels, candidates per level, slots): the search kernel's tile edges (64/65,
# 128/129 slots), depth 64, one to eight candidates, full 256-slot trees
SEARCH_SHAPES = [(1, 1, 1, 3), (3, 4, 6, 2), (2, 8, 5, 17), (2, 16, 4, 64), (1, 64, 2, 65), (2, 12, 8, 128),
                 (1, 20, 3, 129), (1, 64, 4, 256), (2, 10, 8, 256), (2, 64, 3, 100)]


def search_cases(generator, device="cpu"):
    """Inputs of ``level_search_packed`` (roots, probs, tokens, caps, slots, calibration) over
    :data:`SEARCH_SHAPES`: probabilities as softmax, uniform (ties everywhere), quarters (ties and
    zeros) or heavy-tailed; calibration factors with zeros (scores of -inf); ragged and zero budgets,
    the last request's full; the last case's last request sure of its first choice (a main path to
    depth 64)."""
    g = generator
    for it, (B, D, K, S) in enumerate(SEARCH_SHAPES):
        probs = [torch.rand(B, D, K, generator=g).softmax(-1), torch.full((B, D, K), 1.0 / K),
                 torch.randint(0, 4, (B, D, K), generator=g).float() / 4,
                 torch.rand(B, D, K, generator=g) ** 4][it % 4].sort(-1, descending=True).values
        tokens = torch.randint(0, 1000, (B, D, K), generator=g)
        cal = (torch.rand(65, 3, generator=g) * 2).masked_fill(torch.rand(65, 3, generator=g) < 0.05, 0.0)
        caps = torch.randint(0, S, (B,), generator=g)
        caps[-1] = S - 1
        if it == len(SEARCH_SHAPES) - 1:
            probs[-1, :, 0], cal = 0.999, torch.ones(65, 3)
        roots = torch.randint(0, 1000, (B,), generator=g)
        yield tuple(x.to(device) if torch.is_tensor(x) else x for x in (roots, probs, tokens, caps, S, cal))
