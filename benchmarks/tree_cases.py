"""Tree cases shared by the recurrent-layer tree benchmarks (bench_gdn_tree.py, bench_mamba2_tree.py,
bench_mamba1_tree.py).

- ``random_trees(B, N, gen)``: B random recursive trees of N nodes (root included), depth <= 16.
- ``seeded_trees(B, N, seed)``: a case's first draw, ``random_trees`` from a fresh seeded generator (and that generator).
- ``accept_random_paths(tree, gen)``: per request, a random node's root path as the accepted path
  (``accepted [B, P]`` local indices, root first, -1 padded; P = max depth + 1).
- ``root_to_leaf_paths(tree, acc_node)``: the serial baselines' work: every root-to-leaf path as a
  sequence of flat node rows, its request, and per request one path through the accepted node
  with the accepted node's position on it.
- ``accepted_flat(tree, acc_node)``: flat index of each request's accepted node (per-node baselines
  copy that node's state into the slot).
- ``to_device(case, dev)``: the device copies every method reads (tree, slots, accepted).
- ``rel_err(a, b)`` and ``baseline_errors(...)``: the accuracy checks of the recurrent benchmarks.
- ``print_summary(rows)``: the closing table both benchmarks print.
- ``bastion_parents(n, gen)`` / ``branches_of(parents)``: bench_tree_attention.py's best-first
  trees and their root-to-leaf paths.
Random draws happen in a fixed order (trees, then the caller's inputs, then the accepted paths,
then the slot permutation) so a seed gives the same case in every benchmark run.
"""
from __future__ import annotations

import heapq

import torch

from vllm_bole.testing.oracles import random_tree_batch


def random_trees(B: int, N: int, gen, max_depth: int = 16):
    return random_tree_batch([N] * B, kind="random", max_depth=max_depth, generator=gen)


def seeded_trees(B: int, N: int, seed: int):
    """(trees, gen): ``random_trees(B, N, gen)`` drawn first from a generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return random_trees(B, N, gen), gen


def accept_random_paths(tree, gen):
    """(accepted [B, P] int64, acc_node [B] list of local indices, P)."""
    B = tree.num_requests
    P = tree.max_depth + 1
    acc = torch.full((B, P), -1, dtype=torch.int64)
    acc_node = []
    for r in range(B):
        par, _ = tree.request(r)
        i = int(torch.randint(len(par), (1,), generator=gen))
        acc_node.append(i)
        path = []
        while i >= 0:
            path.append(i)
            i = par[i]
        acc[r, : len(path)] = torch.tensor(path[::-1])
    return acc, acc_node, P


def finish_case(case: dict, tree, gen) -> dict:
    """Add the accepted paths and a random slot permutation (drawn after the caller's inputs)."""
    acc, acc_node, P = accept_random_paths(tree, gen)
    slots = torch.randperm(tree.num_requests, generator=gen).to(torch.int32)
    case.update(tree=tree, acc=acc, acc_node=acc_node, slots=slots, P=P,
                m_mean=float((acc >= 0).sum(1).float().mean()))
    return case


def root_to_leaf_paths(tree, acc_node):
    """dict(rows [flat node rows of all paths, concatenated], cu [num_paths + 1], req [num_paths]
    request of each path, acc_path [B] a path through the accepted node, acc_pos [num_paths]
    position of the accepted node on the request's acc_path, -1 on every other path)."""
    rows, cu, req, acc_path = [], [0], [], {}
    acc_pos = []
    for r in range(tree.num_requests):
        par, _ = tree.request(r)
        s = int(tree.cu_nodes[r])
        is_parent = set(par)
        for leaf in range(len(par)):
            if leaf in is_parent:
                continue
            path, i = [], leaf
            while i >= 0:
                path.append(i)
                i = par[i]
            path = path[::-1]
            pos = -1
            if r not in acc_path and acc_node[r] in path:
                acc_path[r] = len(req)
                pos = path.index(acc_node[r])
            rows += [s + i for i in path]
            cu.append(len(rows))
            req.append(r)
            acc_pos.append(pos)
    return dict(rows=rows, cu=cu, req=req, acc_path=[acc_path[r] for r in range(tree.num_requests)], acc_pos=acc_pos)


def accepted_flat(tree, acc_node, dev):
    return tree.cu_nodes[:-1].to(dev).long() + torch.tensor(acc_node, device=dev)


def to_device(case: dict, dev) -> dict:
    case.update(tree_dev=case["tree"].to(dev), slots_dev=case["slots"].to(dev), acc_dev=case["acc"].to(dev))
    return case


def rel_err(a, b) -> float:
    """Relative L2 error of ``a`` against ``b``, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def baseline_errors(c, state, cfg, setups: dict, y_ref, want) -> dict:
    """Per baseline (``setups``: name -> ``setup(case, state, cfg)`` returning ``(run, ...)``), the
    errors of its outputs and of the slots' states after one run on a copy of ``state``."""
    out = {}
    for name, setup in setups.items():
        st = state.clone()
        y = setup(c, st, cfg)[0]()
        out[name] = (rel_err(y, y_ref), rel_err(st[c["slots_dev"].long()], want))
    return out


def print_summary(rows):
    print("\nconfig              B    N   ours_ms  floor_ms  x_floor  serial_x  per_node_x  mem_x")
    for r in rows:
        print(f"{r['config']:18s} {r['B']:4d} {r['N']:4d} {r['ours_ms']:9.4f} {r['floor_ms']:9.4f} {r['ours_ms'] / r['floor_ms']:7.2f} "
              f"{r['serial_ms'] / r['ours_ms']:9.1f} {r['per_node_ms'] / r['ours_ms']:10.1f} "
              f"{r['per_node_transient_bytes'] / r['ours_transient_bytes']:7.1f}")


def bastion_parents(n: int, gen: torch.Generator, width: int = 6, max_depth: int = 16, peak: float = 3.0) -> list[int]:
    """Best-first tree of ``n`` nodes: per-depth marginals over ``width`` ranked tokens, node score
    = product of marginals along the path, always expand the best frontier candidate."""
    marg = [torch.softmax(torch.randn(width, generator=gen) * peak, 0).sort(descending=True).values.tolist()
            for _ in range(max_depth + 1)]
    parents, depth, rho = [-1], [0], [1.0]
    heap = [(-marg[1][0], 0, 0)]
    while len(parents) < n and heap:
        neg, par, r = heapq.heappop(heap)
        new = len(parents)
        parents.append(par)
        depth.append(depth[par] + 1)
        rho.append(-neg)
        d = depth[par] + 1
        if r + 1 < width:
            heapq.heappush(heap, (-rho[par] * marg[d][r + 1], par, r + 1))
        if depth[new] < max_depth:
            heapq.heappush(heap, (-rho[new] * marg[depth[new] + 1][0], new, 0))
    return parents


def branches_of(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf paths (local indices) of one tree."""
    n = len(parents)
    has_child = [False] * n
    for p in parents[1:]:
        has_child[p] = True
    out = []
    for leaf in range(n):
        if not has_child[leaf]:
            path, x = [], leaf
            while x >= 0:
                path.append(x)
                x = parents[x]
            out.append(path[::-1])
    return out
